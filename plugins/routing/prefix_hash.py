"""Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018) over the hash of a request's
first blocks: requests that open alike go to the same worker, unless it already carries more than its share.

The key: a hash of the first ``prefix_blocks`` full blocks of the prompt's tokens (all of it when it is shorter), so
sessions that share a system prompt or a conversation's first turns share a worker. Each worker sits at
``virtual_nodes`` points of a hash ring; a request goes to the first candidate clockwise from its key whose requests
in flight are below ``ceil(load_factor * (in flight over the candidates + 1) / candidates)`` ("hash" when that is
the key's own worker, "overflow" when it had to move on). No view of the caches, no events: affinity alone.
"""
from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from dataclasses import dataclass

from framework.kv_events.hashing import MASK64, ROOT_HASH, chain_hashes
from framework.core.registry import ROUTING
from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision, RoutingPolicy


@dataclass
class PrefixHashConfig(RoutingConfig):
    name: str = "prefix_hash"
    block_size: int = 16
    prefix_blocks: int = 16      # the key covers this many leading blocks (256 tokens by default)
    load_factor: float = 1.25    # c: no worker takes more than c x the mean load (+1)
    virtual_nodes: int = 64      # points per worker on the ring


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@ROUTING.register("prefix_hash")
class PrefixHashRouting(RoutingPolicy):
    Config = PrefixHashConfig
    Reasons = ("hash", "overflow")

    def __init__(self, cfg: PrefixHashConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        c = self.cfg
        problems = [f"{k}={getattr(c, k)} must be >= 1" for k in ("block_size", "prefix_blocks", "virtual_nodes")
                    if getattr(c, k) < 1]
        if c.load_factor < 1:
            problems.append(f"load_factor={c.load_factor} must be >= 1 (1: perfectly even)")
        if problems:
            raise ValueError("router=prefix_hash: " + "; ".join(problems))
        self._ring: list[tuple[int, str]] = []
        self._points: list[int] = []

    def _worker_added(self, worker: str) -> None:
        self._ring += [(_point(f"{worker}#{i}".encode()), worker) for i in range(self.cfg.virtual_nodes)]
        self._reindex()

    def _worker_removed(self, worker: str) -> None:  # a reset keeps its place on the ring: no cache state here
        self._ring = [p for p in self._ring if p[1] != worker]
        self._reindex()

    def state_sizes(self) -> dict[str, int]:
        return {"ring_points": len(self._ring)}

    def _reindex(self) -> None:
        self._ring.sort()
        self._points = [p for p, _ in self._ring]

    def key(self, request: RequestView) -> int:
        """The hash of the request's first ``prefix_blocks`` full blocks (of all its tokens when it has none)."""
        tokens = request.token_ids if request.token_ids is not None else request.text.encode("utf-8")
        b = self.cfg.block_size
        prefix = tokens[:b * self.cfg.prefix_blocks]
        full = chain_hashes(prefix, b)
        return full[-1] if full else hash((ROOT_HASH, *prefix)) & MASK64

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        loads = self.loads
        wanted = set(candidates)
        cap = math.ceil(self.cfg.load_factor * (sum(loads[w] for w in candidates) + 1) / len(candidates))
        ring, start = self._ring, bisect_right(self._points, self.key(request))
        first = None
        for i in range(len(ring)):
            worker = ring[(start + i) % len(ring)][1]
            if worker not in wanted:
                continue
            first = first or worker
            if loads[worker] < cap:
                break
        n = len(request.text)
        return RoutingDecision(worker, 0, n, "hash" if worker == first else "overflow")
