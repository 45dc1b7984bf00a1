"""The engine seams the simulator added keep the engine's decisions: the radix cache's incremental eviction heap
against SGLang's full walk over the tree (the brute-force oracle), on random operation sequences."""
from __future__ import annotations

import heapq
import random

import pytest
import torch

from framework.engine.radix_cache import RadixCache


class FullScanCache(RadixCache):
    """SGLang's evict: collect every unlocked leaf, heapify, pop (parents join as they become leaves)."""

    def evict(self, num_tokens: int) -> int:
        leaves = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed


def _tree(cache: RadixCache) -> list:
    out, stack = [], [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = path + tuple(child.key)
            out.append((key, child.value.tolist(), child.lock_ref))
            stack.append((child, key))
    return sorted(out)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_eviction_makes_the_full_scans_decisions(seed):
    rng = random.Random(seed)
    freed: dict[str, list] = {"heap": [], "scan": []}
    caches = {"heap": RadixCache(lambda v: freed["heap"].append(v.tolist())),
              "scan": FullScanCache(lambda v: freed["scan"].append(v.tolist()))}
    locked: list = []
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    for step in range(400):
        op = rng.random()
        key = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        if op < 0.45:
            value = torch.arange(step * 100, step * 100 + len(key))
            assert caches["heap"].insert(key, value) == caches["scan"].insert(key, value)
        elif op < 0.7:
            nodes = {k: c.match_prefix(key)[1] for k, c in caches.items()}
            if rng.random() < 0.5:
                for k, c in caches.items():
                    c.inc_lock_ref(nodes[k])
                locked.append(nodes)
        elif op < 0.8 and locked:
            nodes = locked.pop(rng.randrange(len(locked)))
            for k, c in caches.items():
                c.dec_lock_ref(nodes[k])
        else:
            n = rng.randrange(1, 12)
            assert caches["heap"].evict(n) == caches["scan"].evict(n)
        assert freed["heap"] == freed["scan"]
        assert _tree(caches["heap"]) == _tree(caches["scan"])
        assert caches["heap"].evictable_size() == caches["scan"].evictable_size()
    assert freed["heap"]            # eviction ran
