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
see _radix_tree.py), not only by the periodic pass, so memory holds at any request rate.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision, RoutingPolicy
from plugins.routing.lib.radix_tree import RadixTree, mix64

TIE_BREAKS = ("node_hash", "least_loaded", "most_recent", "first")


MISS_POLICIES = ("smallest_tree", "least_loaded")


@dataclass
class CacheAwareConfig(RoutingConfig):
    name: str = "cache_aware"
    cache_threshold: float = 0.5  # match rate must exceed this for a cache hit
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2 ** 24  # characters per worker
    tie_break: str = "node_hash"  # among workers holding the longest match: node_hash | least_loaded | most_recent | first
    miss_policy: str = "smallest_tree"  # smallest_tree (v0.4) | least_loaded (later versions)


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

    def __init__(self, cfg: CacheAwareConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        _check_config(self.cfg)
        # bounded at every insert, besides the periodic pass; most_recent reads the last access of inner nodes
        self.tree = RadixTree(self.cfg.max_tree_size, stamp_path=self.cfg.tie_break == "most_recent")
        self._last_eviction: float | None = None  # set by the first maintain(), in the caller's time base
        self._seed_key = mix64(seed)
        self._tenant_keys: dict[str, int] = {}  # worker -> its 64-bit hash, for node_hash

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
                if len(holders) == 1 or cfg.tie_break == "first":
                    worker = holders[0]
                elif cfg.tie_break == "node_hash":
                    node_key = mix64(self._seed_key ^ at.serial)
                    worker = min(holders, key=lambda w: mix64(node_key ^ self._tenant_key(w)))
                elif cfg.tie_break == "least_loaded":
                    worker = min(holders, key=loads.__getitem__)
                else:  # most_recent: the holder that touched the matched node last
                    worker = max(holders, key=at.tenants.__getitem__)
            else:
                reason = "cache_miss"
                if cfg.miss_policy == "smallest_tree":
                    worker = min(candidates, key=tree.tenant_size)
                else:
                    worker = min(candidates, key=loads.__getitem__)
        now = self.clock()
        held = tree.insert_at(request_text, matched, node, worker, now)
        return RoutingDecision(worker, held, n, reason, request_text, now)

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
        self.tree.remove_tenant(worker)

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
