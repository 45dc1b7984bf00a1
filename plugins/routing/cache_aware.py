"""SGLang's cache-aware router (v0.4 / sgl-router 0.1.0), decision for decision.

1. Imbalanced -- (max_load - min_load) > balance_abs_threshold AND max_load > min_load * balance_rel_threshold over
   the candidates -- -> the least-loaded worker ("balance").
2. Otherwise match the request text against the one shared radix tree. Match rate = matched chars / request chars;
   rate > cache_threshold -> a worker that was sent the longest match ("cache_hit", ties settled by ``tie_break``);
   else the worker with the smallest tree (v0.4) or the least-loaded one (``miss_policy``) ("cache_miss").
3. The request text is inserted into the tree for the chosen worker, whatever the reason.

Every comparison is strict, as in SGLang. One walk down the tree serves both the match and the insert. Ties among
the workers holding the longest match: ``node_hash`` (default) takes the first in a stable order per tree node that
the seed fixes, as sgl-router 0.1.0 took the first entry of the node's hash map (a per-map random hasher);
``least_loaded``, ``most_recent`` and ``first`` (insertion order) are named variants. Other differences from the
Rust code, on purpose: an empty request counts as a miss (Rust computed 0/0 = NaN, which also fails ``>``), and a
match no longer refreshes the access time of a tenant that is not chosen.

Keeping the estimate honest (docs/fidelity.md): an insert is taken back when the router's attempt fails
(``on_request_done(ok=False)``), a worker whose cache was flushed or restarted is forgotten (``reset_worker``), and a
worker's share of the tree is bounded at every insert (evicted down to ``max_tree_size`` once it passes it by 1/32,
see _radix_tree.py), not only by the periodic pass, so memory holds at any request rate. The tree hears of a flush only
when the router makes it (its ``/flush_cache``); with ``follow_flushes`` (servelab's, off: SGLang's tree keeps a
flushed worker's entries) it subscribes to the workers' KV events for their ``AllBlocksCleared`` alone, so a flush
made on a worker directly forgets that worker's entries too.
"""
from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import (KV_EVENTS, SGLANG_ROUTER_VERSION, NotExpressible, RequestView, RoutingConfig,
                                         RoutingDecision, RoutingPolicy)
from plugins.routing.lib.radix_tree import RadixTree, mix64


class TieBreak(enum.StrEnum):
    """Which of the workers holding the longest match a cache hit goes to (``router.tie_break``)."""
    node_hash = "node_hash"        # the first in a stable order per tree node, fixed by the seed (sgl-router 0.1.0)
    least_loaded = "least_loaded"
    most_recent = "most_recent"    # the one that touched the matched node last
    first = "first"                # insertion order


class MissPolicy(enum.StrEnum):
    """Where a cache miss goes (``router.miss_policy``)."""
    smallest_tree = "smallest_tree"  # the worker with the smallest tree (v0.4)
    least_loaded = "least_loaded"    # the least-loaded worker (later versions)


TIE_BREAKS = tuple(t.value for t in TieBreak)
MISS_POLICIES = tuple(m.value for m in MissPolicy)


@dataclass
class CacheAwareConfig(RoutingConfig):
    name: str = "cache_aware"
    cache_threshold: float = 0.5  # match rate must exceed this for a cache hit
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2 ** 24  # characters per worker
    tie_break: TieBreak = TieBreak.node_hash  # among workers holding the longest match
    miss_policy: MissPolicy = MissPolicy.smallest_tree
    follow_flushes: bool = False  # forget a worker's entries at its AllBlocksCleared event too (servelab's)


def _check_config(cfg: CacheAwareConfig) -> None:
    problems = []
    if not 0.0 <= cfg.cache_threshold <= 1.0:
        problems.append(f"cache_threshold={cfg.cache_threshold} must be in [0, 1]")
    if cfg.balance_abs_threshold < 0:
        problems.append(f"balance_abs_threshold={cfg.balance_abs_threshold} must be >= 0")
    if cfg.balance_rel_threshold < 0:
        problems.append(f"balance_rel_threshold={cfg.balance_rel_threshold} must be >= 0")
    if cfg.eviction_interval_secs <= 0:
        problems.append(f"eviction_interval_secs={cfg.eviction_interval_secs} must be > 0")
    if cfg.max_tree_size < 0:
        problems.append(f"max_tree_size={cfg.max_tree_size} must be >= 0")
    if cfg.tie_break not in TIE_BREAKS:
        problems.append(f"tie_break={cfg.tie_break!r} is not one of {TIE_BREAKS}")
    if cfg.miss_policy not in MISS_POLICIES:
        problems.append(f"miss_policy={cfg.miss_policy!r} is not one of {MISS_POLICIES}")
    if problems:
        raise ValueError("router=cache_aware: " + "; ".join(problems))


@ROUTING.register("cache_aware")
class CacheAwareRouting(RoutingPolicy):
    Config = CacheAwareConfig
    Reasons = ("balance", "cache_hit", "cache_miss")
    keeps_estimate = True
    sglang_ignores = ("tie_break",)   # SGLang's tree picks among equal matches itself (no flag)

    def __init__(self, cfg: CacheAwareConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        _check_config(self.cfg)
        # bounded at every insert, besides the periodic pass; most_recent reads the last access of inner nodes
        self.tree = RadixTree(self.cfg.max_tree_size, stamp_path=self.cfg.tie_break == TieBreak.most_recent)
        self._last_eviction: float | None = None  # set by the first maintain(), in the caller's time base
        self._seed_key = mix64(seed)
        self._tenant_keys: dict[str, int] = {}  # worker -> its 64-bit hash, for node_hash
        if self.cfg.follow_flushes:  # for AllBlocksCleared only (the base class resets the worker on it)
            self.subscriptions = frozenset({KV_EVENTS})

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        request_text = request.text
        cfg = self.cfg
        loads = self.loads
        tree = self.tree
        matched, node = tree.walk(request_text)
        n = len(request_text)
        if self._imbalanced(candidates):
            worker = min(candidates, key=loads.__getitem__)
            reason = "balance"
        else:
            best, holders, at = self._holders(matched, node, candidates)
            if n and best / n > cfg.cache_threshold:
                reason = "cache_hit"
                if len(holders) == 1 or cfg.tie_break == TieBreak.first:
                    worker = holders[0]
                elif cfg.tie_break == TieBreak.node_hash:
                    node_key = mix64(self._seed_key ^ at.serial)
                    worker = min(holders, key=lambda w: mix64(node_key ^ self._tenant_key(w)))
                elif cfg.tie_break == TieBreak.least_loaded:
                    worker = min(holders, key=loads.__getitem__)
                else:  # most_recent: the holder that touched the matched node last
                    worker = max(holders, key=at.tenants.__getitem__)
            else:
                reason = "cache_miss"
                if cfg.miss_policy == MissPolicy.smallest_tree:
                    worker = min(candidates, key=tree.tenant_size)
                else:
                    worker = min(candidates, key=loads.__getitem__)
        now = self.clock()
        held = tree.insert_at(request_text, matched, node, worker, now)
        return RoutingDecision(worker, held, n, reason, request_text, now)

    @classmethod
    def sglang_args(cls, cfg: CacheAwareConfig) -> list[str]:
        """sglang-router's cache_aware with the same thresholds. Its cache miss goes to the least-loaded worker, so
        ``miss_policy`` must be least_loaded (router=cache_aware_v2); it takes whole seconds between evictions; its
        max_tree_size counts characters per worker, as ours. Ties among equal matches are its tree's (no flag). The
        miss was checked on the 0.3.2 binary: eight unrelated prompts sent one after another in front of two idle
        workers all went to the same worker, where a smallest-tree miss would alternate between them."""
        if cfg.miss_policy != MissPolicy.least_loaded:
            raise NotExpressible(
                f"sglang-router {SGLANG_ROUTER_VERSION} sends a cache miss to the least-loaded worker; "
                f"router.miss_policy={str(cfg.miss_policy)!r} (SGLang v0.4's smallest tree) cannot be expressed. Use "
                f"router=cache_aware_v2, or router.miss_policy=least_loaded with the thresholds you want")
        if cfg.follow_flushes:
            raise NotExpressible("sglang-router's tree keeps a worker's entries when the worker is flushed directly; "
                                 "router.follow_flushes=true (servelab's) cannot be expressed: drop it")
        if cfg.eviction_interval_secs != int(cfg.eviction_interval_secs):
            raise NotExpressible(f"sglang-router takes whole seconds; router.eviction_interval_secs="
                                 f"{cfg.eviction_interval_secs} is not")
        return ["--policy", "cache_aware", "--cache-threshold", repr(float(cfg.cache_threshold)),
                "--balance-abs-threshold", str(int(cfg.balance_abs_threshold)),
                "--balance-rel-threshold", repr(float(cfg.balance_rel_threshold)),
                "--eviction-interval-secs", str(int(cfg.eviction_interval_secs)),
                "--max-tree-size", str(int(cfg.max_tree_size))]

    def _tenant_key(self, worker: str) -> int:
        key = self._tenant_keys.get(worker)
        if key is None:
            key = self._tenant_keys[worker] = mix64(zlib.crc32(worker.encode()))
        return key

    def _imbalanced(self, candidates: list[str]) -> bool:
        loads = self.loads
        lo = hi = loads[candidates[0]]
        for w in candidates:
            x = loads[w]
            if x < lo:
                lo = x
            elif x > hi:
                hi = x
        return hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold

    def _holders(self, matched: int, node, candidates: list[str]):
        """(chars, candidates that were sent them, node) for the longest prefix any candidate was sent: the deepest
        node on the match path holding a candidate -- the node the match ended on, unless ``select`` was given a
        subset of the workers that excludes everyone there."""
        root = self.tree.root
        while node is not root:
            tenants = node.tenants
            holders = [w for w in candidates if w in tenants]
            if holders:
                return matched, holders, node
            node = node.parent
            matched = node.end
        return 0, [], root

    def _forget(self, worker: str) -> None:
        self.tree.remove_tenant(worker)  # reset (servelab's, docs/fidelity.md) and removal (sgl-router's too)

    def _worker_removed(self, worker: str) -> None:
        self._forget(worker)
        self._tenant_keys.pop(worker, None)

    def state_sizes(self) -> dict[str, int]:
        tree = self.tree
        return {"tree_nodes": tree.node_count, "tree_chars": tree.total_chars, "tree_queue_entries": tree._queued}

    def _take_back(self, d: RoutingDecision) -> None:
        self.tree.undo_insert(d.text, d.worker, d.matched_chars, d.at)

    def maintain(self, now: float | None = None) -> None:
        """LRU eviction down to ``max_tree_size`` characters per worker, once every ``eviction_interval_secs``; the first
        call starts the interval (SGLang's eviction thread also slept one interval before its first pass)."""
        now = self.clock() if now is None else now
        if self._last_eviction is None:
            self._last_eviction = now
        elif now - self._last_eviction >= self.cfg.eviction_interval_secs:
            self.tree.evict(self.cfg.max_tree_size)
            self._last_eviction = now
