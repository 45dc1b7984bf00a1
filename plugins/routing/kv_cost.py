"""Dynamo's KV router: the worker whose cost -- the prefill it would still have to do against the blocks it already
decodes for -- is lowest, from the exact view of the workers' caches (KV events).

For each candidate w, with the request's P prompt tokens in B-token blocks:
    prefill_blocks(w) = (P - cached(w) + prefill_tokens_in_flight(w)) / B
    active_blocks(w)  = blocks_in_flight(w) + ceil(P / B)
    cost(w)           = overlap_score_weight * prefill_blocks(w) + active_blocks(w)
where cached(w) is what w holds of the prompt (leading full blocks of the exact view: _kv_view.py) and the in-flight
figures count the requests the router sent w that have not ended. Lowest cost wins (ties: fewer blocks in flight, then
the first added); with ``temperature`` > 0 the worker is drawn with probability ~ exp(-cost' / temperature), cost'
the costs scaled to [0, 1] (Dynamo's softmax sampling). Differences from Dynamo (docs/routing.md): a request's prefill
counts until it ends (Dynamo: until its first token) and its decode blocks are its prompt's (Dynamo adds the tokens
generated so far), since the router hears of a request only at its start and end.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestUsage, RequestView, RoutingDecision
from plugins.routing.lib.kv_policy import KvViewConfig, KvViewPolicy


@dataclass
class KvCostConfig(KvViewConfig):
    name: str = "kv_cost"
    overlap_score_weight: float = 1.0  # Dynamo's --kv-overlap-score-weight: prefill against decode
    temperature: float = 0.0           # Dynamo's --router-temperature: 0 = the lowest cost, always


@ROUTING.register("kv_cost")
class KvCostRouting(KvViewPolicy):
    Config = KvCostConfig
    Reasons = ("overlap", "no_overlap")

    def __init__(self, cfg: KvCostConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        self._rng = random.Random(seed)
        self.active_blocks: dict[str, int] = {}   # worker -> blocks of its requests in flight

    @staticmethod
    def _check_config(cfg: KvCostConfig) -> list[str]:
        problems = KvViewPolicy._check_config(cfg)
        if cfg.overlap_score_weight < 0:
            problems.append(f"overlap_score_weight={cfg.overlap_score_weight} must be >= 0")
        if cfg.temperature < 0:
            problems.append(f"temperature={cfg.temperature} must be >= 0")
        return problems

    def costs(self, req, candidates: list[str]) -> tuple[dict[str, float], dict[str, int]]:
        """(cost per candidate, leading blocks each holds) for the request's ``RequestBlocks``."""
        b, n = self.cfg.block_size, len(req.tokens)
        blocks = -(-n // b)
        matched = self.match(req, candidates)
        w8, top, pending, active = self.cfg.overlap_score_weight, max(n - 1, 0), self.prefill_tokens, self.active_blocks
        cost = {}
        for w in candidates:  # ``estimate`` inlined: the prompt tokens each holds, all but the last at most
            m = matched[w] * b
            cost[w] = w8 * (n - (m if m < top else top) + pending.get(w, 0)) / b + active.get(w, 0) + blocks
        return cost, matched

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        req = self.blocks(request)
        n = len(req.tokens)
        cost, matched = self.costs(req, candidates)
        active = self.active_blocks
        if self.cfg.temperature > 0 and len(candidates) > 1:
            worker = self._sample(cost, candidates)
        else:  # the lowest cost; ties: fewer blocks in flight, then the first added
            worker = min(candidates, key=lambda w: (cost[w], active.get(w, 0)))
        m = matched[worker]
        held = self.estimate(m, n)
        blocks = -(-n // self.cfg.block_size)
        active[worker] = active.get(worker, 0) + blocks
        return self.decision(worker, req, m, "overlap" if m else "no_overlap", self.credit(worker, req, m), n - held,
                             blocks)

    def _sample(self, cost: dict[str, float], candidates: list[str]) -> str:
        lo, hi = min(cost.values()), max(cost.values())
        span = (hi - lo) or 1.0
        weights = [math.exp(-(cost[w] - lo) / span / self.cfg.temperature) for w in candidates]
        return self._rng.choices(candidates, weights)[0]

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        super()._settle(decision, ok, usage)
        self.active_blocks[decision.worker] -= decision.memo.blocks

    def _worker_removed(self, worker: str) -> None:
        super()._worker_removed(worker)
        self.active_blocks.pop(worker, None)  # in flight: settled by its requests' ends, which no longer come

    def state_sizes(self) -> dict[str, int]:
        return {**super().state_sizes(), "active_workers": len(self.active_blocks)}
