"""The yardstick for the cache-aware policy's cost: a plain pure-Python radix tree making the same decisions.

One dict of children per node, a {tenant: last access} dict per node, per-tenant character counts; no LRU queue, no
eviction, no undo, no candidate subsets, no policy base class. It makes SGLang v0.4's cache-aware decision with the
``node_hash`` tie break exactly as plugins/routing/cache_aware.py does (bench_decisions checks that both pick the
same worker for every request), so the difference in time per decision is what the real policy's extra machinery
costs. Not a plugin: it serves bench_decisions only.
"""
from __future__ import annotations

import time
import zlib

from plugins.routing.lib.radix_tree import mix64


class Node:
    __slots__ = ("text", "children", "tenants", "parent", "end", "serial")

    def __init__(self, text: str, parent: "Node | None", end: int, serial: int):
        self.text, self.parent, self.end, self.serial = text, parent, end, serial
        self.children: dict[str, Node] = {}
        self.tenants: dict[str, float] = {}


class PlainCacheAware:
    def __init__(self, workers: list[str], threshold: float = 0.5, abs_gap: int = 32, rel_gap: float = 1.0001,
                 seed: int = 0):
        self.workers, self.threshold, self.abs_gap, self.rel_gap = list(workers), threshold, abs_gap, rel_gap
        self.loads = dict.fromkeys(workers, 0)
        self.sizes = dict.fromkeys(workers, 0)  # characters each worker was sent (distinct prefixes)
        self.keys = {w: mix64(zlib.crc32(w.encode())) for w in workers}
        self.seed_key = mix64(seed)
        self.root = Node("", None, 0, 0)
        self.serial = 0

    def select(self, text: str) -> tuple[str, int]:
        """(worker, characters of ``text`` it was sent before)."""
        loads = self.loads
        node, pos, cut = self.root, 0, 0
        while pos < len(text):  # walk: the longest prefix of text sent to anyone
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.text
            if text.startswith(edge, pos):
                node, pos = child, pos + len(edge)
                continue
            cut = 1  # the match ends inside the child's edge: it holds the tenants; split it at insert
            while cut < len(edge) and pos + cut < len(text) and edge[cut] == text[pos + cut]:
                cut += 1
            node, pos = child, pos + cut
            break
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.abs_gap and hi > lo * self.rel_gap:  # imbalanced: the least loaded
            worker = min(self.workers, key=loads.__getitem__)
        elif text and pos / len(text) > self.threshold:
            holders = list(node.tenants)
            node_key = mix64(self.seed_key ^ node.serial)
            worker = min(holders, key=lambda w: mix64(node_key ^ self.keys[w]))
        else:
            worker = min(self.workers, key=self.sizes.__getitem__)
        if cut:
            node = self._split(node, cut)
        return worker, self._insert(text, pos, node, worker)

    def done(self, worker: str) -> None:
        self.loads[worker] -= 1

    def _split(self, node: Node, at: int) -> Node:
        """A new parent for ``node`` holding its first ``at`` characters of text (and its tenants)."""
        self.serial += 1
        upper = Node(node.text[:at], node.parent, node.end - len(node.text) + at, self.serial)
        upper.tenants = dict(node.tenants)
        node.parent.children[node.text[0]] = upper
        node.text, node.parent = node.text[at:], upper
        upper.children[node.text[0]] = node
        return upper

    def _insert(self, text: str, pos: int, node: Node, worker: str) -> int:
        now = time.monotonic()
        self.loads[worker] += 1
        if pos < len(text):
            self.serial += 1
            leaf = Node(text[pos:], node, len(text), self.serial)
            leaf.tenants[worker] = now
            node.children[text[pos]] = leaf
            self.sizes[worker] += len(text) - pos
        held, root, sizes = 0, self.root, self.sizes
        while node is not root:  # stamp the path; the worker joins the nodes it was missing from
            tenants = node.tenants
            if worker in tenants:  # it holds this node, hence every ancestor
                held = node.end
                while node is not root:
                    node.tenants[worker] = now
                    node = node.parent
                break
            tenants[worker] = now
            sizes[worker] += len(node.text)
            node = node.parent
        return held
