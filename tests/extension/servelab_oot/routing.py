"""router=last_worker: every request to the last candidate (in the order workers were added). Unlike any built-in
policy it never spreads load, so where each request went shows that this policy, and no other, decided."""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision, RoutingPolicy
from framework.core.registry import ROUTING


@dataclass
class LastWorkerConfig(RoutingConfig):
    name: str = "last_worker"


@ROUTING.register("last_worker")
class LastWorker(RoutingPolicy):
    Config = LastWorkerConfig
    Reasons = ("last",)

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        return RoutingDecision(candidates[-1], 0, len(request.text), "last")
