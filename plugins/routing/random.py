"""A uniformly random candidate, from a generator seeded by ``seed`` (so runs reproduce)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision, RoutingPolicy


@dataclass
class RandomConfig(RoutingConfig):
    name: str = "random"


@ROUTING.register("random")
class RandomRouting(RoutingPolicy):
    Config = RandomConfig
    Reasons = ("random",)

    def __init__(self, cfg: RandomConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        self._rng = random.Random(seed)

    @classmethod
    def sglang_args(cls, cfg: RandomConfig) -> list[str]:
        return ["--policy", "random"]

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        return RoutingDecision(self._rng.choice(candidates), 0, len(request.text), "random")
