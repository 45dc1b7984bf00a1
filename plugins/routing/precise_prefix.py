"""The longest exact cached prefix, from the workers' KV events (llm-d's precise prefix-cache scorer), with the load
rules of SGLang's cache-aware router.

1. Imbalanced -- (max_load - min_load) > balance_abs_threshold AND max_load > min_load * balance_rel_threshold over the
   candidates' in-flight counts -- -> the least-loaded worker ("balance").
2. Otherwise each candidate's cached prefix of the request: the leading full blocks it holds in the exact view
   (_kv_view.py: stored by its events, or credited to a request in flight there). Match rate = cached prompt tokens /
   prompt tokens; rate > cache_threshold -> the candidate holding the most ("cache_hit"; ties: the least loaded, then
   the first added);
3. else the least-loaded candidate (``miss_policy=least_loaded``), or the one holding the fewest blocks
   (``smallest_cache``, the exact twin of v0.4's smallest tree) ("cache_miss").
With ``load_factor`` > 0 (servelab's, off by default), steps 2 and 3 choose only among the candidates whose requests in
flight are below ``ceil(load_factor * (in flight over the candidates + 1) / candidates)``, the bound of consistent
hashing with bounded loads: a hot prefix spills onto the next best worker instead of queueing on one.
The estimate (``matched_chars``, in tokens) is what the chosen worker holds of the prompt in the view, at most all
but its last token, which an engine always computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from framework.registry import ROUTING
from framework.routing import RequestView, RoutingDecision
from plugins.routing._kv_policy import Credit, KvViewConfig, KvViewPolicy

MISS_POLICIES = ("least_loaded", "smallest_cache")


@dataclass
class PrecisePrefixConfig(KvViewConfig):
    name: str = "precise_prefix"
    cache_threshold: float = 0.5  # match rate must exceed this for a cache hit
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    miss_policy: str = "least_loaded"  # least_loaded | smallest_cache
    load_factor: float = 0.0  # > 0: no worker past load_factor x the mean in-flight count (+1) takes more (servelab's)


@ROUTING.register("precise_prefix")
class PrecisePrefixRouting(KvViewPolicy):
    Config = PrecisePrefixConfig
    Reasons = ("balance", "cache_hit", "cache_miss")

    @staticmethod
    def _check_config(cfg: PrecisePrefixConfig) -> list[str]:
        problems = KvViewPolicy._check_config(cfg)
        if not 0.0 <= cfg.cache_threshold <= 1.0:
            problems.append(f"cache_threshold={cfg.cache_threshold} must be in [0, 1]")
        if cfg.balance_abs_threshold < 0 or cfg.balance_rel_threshold < 0:
            problems.append("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if cfg.load_factor and cfg.load_factor < 1:
            problems.append(f"load_factor={cfg.load_factor} must be 0 (off) or >= 1")
        if cfg.miss_policy not in MISS_POLICIES:
            problems.append(f"miss_policy={cfg.miss_policy!r} is not one of {MISS_POLICIES}")
        return problems

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        cfg, loads = self.cfg, self.loads
        req = self.blocks(request)
        n = len(req.tokens)
        matched = self.view.match(req.keys, candidates)
        lo = min(loads[w] for w in candidates)
        hi = max(loads[w] for w in candidates)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            worker, reason = min(candidates, key=loads.__getitem__), "balance"
        else:
            if cfg.load_factor:
                cap = math.ceil(cfg.load_factor * (sum(loads[w] for w in candidates) + 1) / len(candidates))
                candidates = [w for w in candidates if loads[w] < cap]
            best = max(matched[w] for w in candidates)
            if n and self.estimate(best, n) / n > cfg.cache_threshold:
                worker = min((w for w in candidates if matched[w] == best), key=loads.__getitem__)
                reason = "cache_hit"
            else:
                by = loads.__getitem__ if cfg.miss_policy == "least_loaded" else self.view.cached_blocks
                worker, reason = min(candidates, key=by), "cache_miss"
        held = matched[worker]
        return self.decision(worker, req, held, reason, Credit(self.credit(worker, req, held)))
