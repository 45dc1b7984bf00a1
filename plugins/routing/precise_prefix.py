"""The longest exact cached prefix, from the workers' KV events (llm-d's precise prefix-cache scorer), with the load
rules of SGLang's cache-aware router.

1. Imbalanced -- (max_load - min_load) > balance_abs_threshold AND max_load > min_load * balance_rel_threshold over the
   candidates' in-flight counts -- -> the least-loaded worker ("balance").
2. Otherwise each candidate's cached prefix of the request: the leading full blocks it holds in the exact view
   (_kv_view.py: stored by its events, or credited to a request in flight there). Match rate = cached prompt tokens /
   prompt tokens; rate > cache_threshold -> the candidate holding the most ("cache_hit"; ties: the least loaded, then
   the first added);
3. else the least-loaded candidate (``miss_policy=least_loaded``), or the one holding the fewest blocks
   (``smallest_cache``, the exact twin of v0.4's smallest tree), or (``least_prefill``, servelab's) the one with the
   least prefill ahead of the request and in it: the prompt tokens its requests in flight had to prefill, plus the
   request's own minus what it holds of it (ties: the least loaded) -- requests count, tokens queue ("cache_miss");
   with ``prefill_slack`` > 0 (servelab's), among the candidates within ``prefill_slack`` x the prompt's tokens of that
   least prefill, the one whose cache has stored the fewest blocks by its events (ties: the least prefill, then the
   least loaded): caches of one size that store alike turn over alike, so a new prefix, which is what a miss
   brings, lives as long wherever it lands and a reuse that comes back late still finds it.
With ``load_factor`` > 0 (servelab's, off by default), steps 2 and 3 choose only among the candidates whose requests in
flight are below ``ceil(load_factor * (in flight over the candidates + 1) / candidates)``, the bound of consistent
hashing with bounded loads: a hot prefix spills onto the next best worker instead of queueing on one.
Two more rules of servelab's, off by default (``router=sticky_prefix`` turns both on, with the 2025 thresholds and
``miss_policy=least_prefill``):
- ``session_affinity``: a request that continues an earlier one (the earlier prompt's full blocks lead this one: the
  next turn of a conversation or an agent loop) goes where the earlier one went ("session"), after the balance rule,
  whatever the view says is left there: a session whose history was evicted is re-prefilled on its own worker instead
  of moving its history onto another worker's cache (SGLang's tree does the same, by not knowing of the eviction).
  The router remembers the last block of the last ``affinity_size`` requests, each until a request continues it (a
  prompt that many later prompts start with, a bare system prompt, is continued once, not by all of them), for
  ``affinity_ttl_s`` at most, and only while its worker keeps the cache it had: a flush, a restart or a lost event
  stream of that worker, or its removal, ends the affinity of every session there (the history it protected is gone:
  the session's next request is routed on the view like a new one).
- ``spill_factor`` > 0: a cache hit that is not a continuation, whose worker already has at least
  ``ceil(spill_factor x (mean requests in flight per candidate + 1))`` requests in flight that start with the same
  block (a hot shared prefix: an agent's tools, a popular system prompt), goes to the candidate holding the most of
  it among those with fewer requests in flight than that ("spill"; ties: the least loaded). Bounded loads, but only
  for the prefix that makes the hot spot, so a session's history and a cold prefix stay where they are.
  With ``spill_pressure`` > 0 only when, besides, the worker's requests in flight have more tokens to prefill than
  ``spill_pressure`` x its cache (the most blocks its events showed it holding): sessions that each bring their own
  history (an agent's steps) would evict one another there, while requests that share the prefix and add a short
  question (a popular system prompt) fit, and spilling them would only prefill the prefix twice.
The estimate (``matched_chars``, in tokens) is what the chosen worker holds of the prompt in the view, at most all
but its last token, which an engine always computes.
"""
from __future__ import annotations

import enum
import math
import itertools
from array import array
from dataclasses import dataclass
from typing import Sequence

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestUsage, RequestView, RoutingDecision
from framework.kv_events.hashing import deepest_in
from plugins.routing.lib.kv_policy import KvViewConfig, KvViewPolicy



class MissPolicy(enum.StrEnum):
    """Where a cache miss goes (``router.miss_policy``)."""
    least_loaded = "least_loaded"
    smallest_cache = "smallest_cache"  # the one holding the fewest blocks (v0.4's smallest tree, exactly)
    least_prefill = "least_prefill"    # the least prefill ahead of the request and in it (servelab's)


MISS_POLICIES = tuple(m.value for m in MissPolicy)


@dataclass
class PrecisePrefixConfig(KvViewConfig):
    name: str = "precise_prefix"
    cache_threshold: float = 0.5  # match rate must exceed this for a cache hit
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    miss_policy: MissPolicy = MissPolicy.least_loaded
    load_factor: float = 0.0  # > 0: no worker past load_factor x the mean in-flight count (+1) takes more (servelab's)
    session_affinity: bool = False  # a continuation goes where the request it continues went (servelab's)
    affinity_size: int = 1 << 20    # requests remembered for session_affinity
    affinity_ttl_s: float = 600.0   # ...each for this long at most (seconds since the request was routed)
    spill_factor: float = 0.0       # > 0: a hot shared prefix spills past this x (mean in flight + 1) (servelab's)
    spill_pressure: float = 0.0     # > 0: ...and only while its worker's in-flight prefill tokens > this x its cache
    prefill_slack: float = 0.0      # > 0 (least_prefill): a miss within this x its prompt of the least prefill goes
                                    # to the cache that has stored the fewest blocks (servelab's)


@ROUTING.register("precise_prefix")
class PrecisePrefixRouting(KvViewPolicy):
    Config = PrecisePrefixConfig
    Reasons = ("balance", "cache_hit", "cache_miss", "session", "spill")

    def __init__(self, cfg: PrecisePrefixConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        # a request's last block key -> (its worker, that worker's epoch, when), oldest first
        self._last_worker: dict[int, tuple[str, int, float]] = {}
        self._epochs = itertools.count(1)
        self._epoch: dict[str, int] = {}  # worker -> the epoch of its cache: a new one at each add and reset
        self._hot: dict[tuple[str, int], int] = {}  # (worker, first block key) -> its requests in flight

    @classmethod
    def ignored_keys(cls, cfg: PrecisePrefixConfig) -> dict[str, str]:
        out = super().ignored_keys(cfg)
        if not cfg.session_affinity:
            for key in ("affinity_size", "affinity_ttl_s"):
                out[key] = ("it bounds session_affinity's memory, and router.session_affinity is off; set "
                            "router.session_affinity=true, or drop it")
        if not cfg.spill_factor:
            out["spill_pressure"] = ("it narrows spill_factor's hot-prefix spill, and router.spill_factor is 0 (off); "
                                     "set router.spill_factor, or drop it")
        return out

    @staticmethod
    def _check_config(cfg: PrecisePrefixConfig) -> list[str]:
        problems = KvViewPolicy._check_config(cfg)
        if not 0.0 <= cfg.cache_threshold <= 1.0:
            problems.append(f"cache_threshold={cfg.cache_threshold} must be in [0, 1]")
        if cfg.balance_abs_threshold < 0 or cfg.balance_rel_threshold < 0:
            problems.append("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if cfg.load_factor and cfg.load_factor < 1:
            problems.append(f"load_factor={cfg.load_factor} must be 0 (off) or >= 1")
        if cfg.affinity_size < 1:
            problems.append(f"affinity_size={cfg.affinity_size} must be >= 1")
        if not cfg.affinity_ttl_s > 0:
            problems.append(f"affinity_ttl_s={cfg.affinity_ttl_s} must be > 0 (seconds)")
        if cfg.spill_factor and cfg.spill_factor < 1:
            problems.append(f"spill_factor={cfg.spill_factor} must be 0 (off) or >= 1")
        if cfg.spill_pressure < 0:
            problems.append(f"spill_pressure={cfg.spill_pressure} must be >= 0")
        if cfg.miss_policy not in MISS_POLICIES:
            problems.append(f"miss_policy={cfg.miss_policy!r} is not one of {MISS_POLICIES}")
        if cfg.prefill_slack < 0:
            problems.append(f"prefill_slack={cfg.prefill_slack} must be >= 0")
        elif cfg.prefill_slack and cfg.miss_policy != MissPolicy.least_prefill:
            problems.append(f"prefill_slack={cfg.prefill_slack} widens miss_policy='least_prefill' only; "
                            f"miss_policy is {str(cfg.miss_policy)!r}")
        return problems

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        cfg, loads = self.cfg, self.loads
        req = self.blocks(request)
        keys = req.keys
        n = len(req.tokens)
        matched = self.match(req, candidates)
        counts = list(map(loads.__getitem__, candidates))
        lo, hi = min(counts), max(counts)
        session = self._session_worker(keys, candidates) if cfg.session_affinity else None
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            worker, reason = min(candidates, key=loads.__getitem__), "balance"
        elif session is not None:
            worker, reason = session, "session"
        else:
            if cfg.load_factor:
                cap = math.ceil(cfg.load_factor * (sum(counts) + 1) / len(candidates))
                candidates = [w for w in candidates if loads[w] < cap]
            blocks = list(map(matched.__getitem__, candidates))
            best = max(blocks)
            if n and min(best * cfg.block_size, n - 1) / n > cfg.cache_threshold:  # the estimate's rate
                if blocks.count(best) == 1:  # (C-level: no tie, the usual case)
                    worker = candidates[blocks.index(best)]
                else:  # ties: the least loaded, then the first added
                    worker = min((w for w in candidates if matched[w] == best), key=loads.__getitem__)
                reason = "cache_hit"
                if cfg.spill_factor and keys:
                    worker, reason = self._spill(worker, keys[0], matched, candidates)
            else:
                if cfg.miss_policy == MissPolicy.least_prefill:
                    pending = self.prefill_tokens
                    ahead = {w: pending.get(w, 0) - self.estimate(matched[w], n) for w in candidates}
                    if cfg.prefill_slack:
                        near = min(ahead.values()) + cfg.prefill_slack * n
                        candidates = [w for w in candidates if ahead[w] <= near]
                        by = lambda w: (self.view.stored_total(w), ahead[w], loads[w])
                    else:
                        by = lambda w: (ahead[w], loads[w])
                else:
                    by = loads.__getitem__ if cfg.miss_policy == MissPolicy.least_loaded else self.view.cached_blocks
                worker, reason = min(candidates, key=by), "cache_miss"
        held = matched[worker]
        credited, first = self.credit(worker, req, held), None
        if keys:
            if cfg.session_affinity:
                self._remember(keys[-1], worker)
            if cfg.spill_factor:
                hot = (worker, keys[0])
                self._hot[hot] = self._hot.get(hot, 0) + 1
                first = keys[0]
        return self.decision(worker, req, held, reason, credited, n - min(held * cfg.block_size, max(n - 1, 0)),
                             first_block=first)

    def _session_worker(self, keys: Sequence[int], candidates: list[str]) -> str | None:
        """The worker of the latest request, not continued yet, whose last block is the deepest of ``keys`` that is
        some request's last block (None: none, or its worker is not a candidate); that request counts as continued."""
        last = self._last_worker
        if type(keys) is array:  # the C keys (hashing.py): searched in C
            key = deepest_in(keys, last)
        else:  # the deepest first, scanned in C
            key = next(filter(last.__contains__, reversed(keys)), None)
        if key is None:
            return None
        worker, epoch, at = last.pop(key)  # a request is continued once: the next turn, not every prompt it leads
        if self._epoch.get(worker) != epoch or self.clock() - at > self.cfg.affinity_ttl_s:
            return None  # its worker's cache was reset since, or it is too old: no affinity left
        return worker if worker in candidates else None

    def _remember(self, key: int, worker: str) -> None:
        last = self._last_worker
        last.pop(key, None)  # re-inserted: the newest
        last[key] = (worker, self._epoch[worker], self.clock())
        if len(last) > self.cfg.affinity_size:
            del last[next(iter(last))]

    def _worker_added(self, worker: str) -> None:
        super()._worker_added(worker)
        self._epoch[worker] = next(self._epochs)

    def _worker_reset(self, worker: str, cause: str) -> None:
        super()._worker_reset(worker, cause)
        self._epoch[worker] = next(self._epochs)  # its sessions' entries no longer count (dropped as they are met)

    def _worker_removed(self, worker: str) -> None:
        super()._worker_removed(worker)
        del self._epoch[worker]
        self._hot = {k: n for k, n in self._hot.items() if k[0] != worker}

    def maintain(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        super().maintain(now)
        last, horizon = self._last_worker, now - self.cfg.affinity_ttl_s
        while last:  # oldest first: drop the sessions past their lifetime (or whose worker's cache was reset)
            key = next(iter(last))
            worker, epoch, at = last[key]
            if at >= horizon and self._epoch.get(worker) == epoch:
                break
            del last[key]

    def state_sizes(self) -> dict[str, int]:
        return {**super().state_sizes(), "sessions": len(self._last_worker), "hot_prefixes": len(self._hot)}

    def _spill(self, worker: str, first: int, matched: dict[str, int], candidates: list[str]) -> tuple[str, str]:
        """(worker, reason) for a cache hit on ``worker``: elsewhere when its requests in flight that start with the
        block ``first`` reach the cap and some candidate is under it."""
        loads = self.loads
        cap = math.ceil(self.cfg.spill_factor * (sum(loads[w] for w in candidates) / len(candidates) + 1))
        under = [w for w in candidates if loads[w] < cap]
        if self._hot.get((worker, first), 0) < cap or not under:
            return worker, "cache_hit"
        pressure = self.cfg.spill_pressure
        if pressure and self.prefill_tokens.get(worker, 0) <= (
                pressure * self.view.capacity_blocks(worker) * self.cfg.block_size):
            return worker, "cache_hit"  # its cache holds what its requests bring: spilling would only re-prefill
        best = max(matched[w] for w in under)
        return min((w for w in under if matched[w] == best), key=loads.__getitem__), "spill"

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        super()._settle(decision, ok, usage)
        first = decision.memo.first_block
        if first is not None:
            hot = (decision.worker, first)
            if self._hot[hot] == 1:
                del self._hot[hot]
            else:
                self._hot[hot] -= 1
