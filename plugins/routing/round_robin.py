"""Round robin over the candidates, as SGLang's router: a counter modulo the number of candidates."""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision, RoutingPolicy


@dataclass
class RoundRobinConfig(RoutingConfig):
    name: str = "round_robin"


@ROUTING.register("round_robin")
class RoundRobinRouting(RoutingPolicy):
    Config = RoundRobinConfig
    Reasons = ("round_robin",)

    def __init__(self, cfg: RoundRobinConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        self._next: dict[str | None, int] = {}  # per role (select_pair), as sglang-router's policy per role

    @classmethod
    def sglang_args(cls, cfg: RoundRobinConfig) -> list[str]:
        return ["--policy", "round_robin"]

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        n = self._next.get(self.role, 0)
        worker = candidates[n % len(candidates)]
        self._next[self.role] = n + 1
        return RoutingDecision(worker, 0, len(request.text), "round_robin")
