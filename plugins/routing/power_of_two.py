"""The power of two choices (Mitzenmacher, 2001): two candidates drawn at random, the less loaded one wins (the
first drawn on a tie), as sglang-router's ``power_of_two``.

``load``: ``in_flight`` (default) counts the requests this router has in flight on each worker; ``worker_tokens``
compares what the workers report instead, as sglang-router 0.3.2 does: the KV tokens their requests hold
(``GET /get_load``'s ``num_tokens``, polled by the router service: a ``LoadReport`` subscription), falling back to
the in-flight count for a worker that has not reported yet.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import (LOAD, LoadReport, NotExpressible, RequestView, RoutingConfig, RoutingDecision,
                                         RoutingPolicy)


class Load(enum.StrEnum):
    """What the two candidates are compared on (``router.load``)."""
    in_flight = "in_flight"          # the requests this router has in flight on each
    worker_tokens = "worker_tokens"  # the KV tokens each reports (GET /get_load), as sglang-router 0.3.2


LOADS = tuple(Load)


@dataclass
class PowerOfTwoConfig(RoutingConfig):
    name: str = "power_of_two"
    load: Load = Load.in_flight


@ROUTING.register("power_of_two")
class PowerOfTwoRouting(RoutingPolicy):
    Config = PowerOfTwoConfig
    Reasons = ("power_of_two",)

    def __init__(self, cfg: PowerOfTwoConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        if self.cfg.load not in LOADS:
            raise ValueError(f"router=power_of_two: load={self.cfg.load!r} is not one of {', '.join(LOADS)}")
        self._rng = random.Random(seed)
        self._reported: dict[str, int] = {}
        if self.cfg.load == Load.worker_tokens:
            self.subscriptions = frozenset({LOAD})

    @classmethod
    def sglang_args(cls, cfg: PowerOfTwoConfig) -> list[str]:
        """sglang-router's power_of_two compares the loads its workers report: ``load=worker_tokens`` only."""
        if cfg.load != Load.worker_tokens:
            raise NotExpressible("sglang-router's power_of_two compares the loads its workers report (GET /get_load's "
                                 "num_tokens); set router.load=worker_tokens to run the same policy")
        return ["--policy", "power_of_two"]

    def _observe(self, worker: str, event) -> None:
        if isinstance(event, LoadReport):
            self._reported[worker] = event.num_tokens

    def _forget(self, worker: str) -> None:
        self._reported.pop(worker, None)  # reset or removed: its next report (or the in-flight count) stands in

    def state_sizes(self) -> dict[str, int]:
        return {"reports": len(self._reported)}

    def _load(self, worker: str) -> int:
        if self.cfg.load == Load.worker_tokens:
            return self._reported.get(worker, self.loads[worker])
        return self.loads[worker]

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        if len(candidates) == 1:
            worker = candidates[0]
        else:
            a, b = self._rng.sample(candidates, 2)
            worker = a if self._load(a) <= self._load(b) else b
        return RoutingDecision(worker, 0, len(request.text), "power_of_two")
