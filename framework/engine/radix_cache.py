"""A token-level radix prefix cache (SGLang's RadixCache, page size 1).

Edges hold token lists and the KV slots of those tokens. A request locks the path to its matched node
(reference counts up to the root) so that the slots it reads cannot be evicted; eviction frees the least
recently used unlocked leaves. The cache owns every slot in the tree; requests own the slots they add until they
are inserted.
"""
from __future__ import annotations

import heapq
import itertools
import time

import torch

_clock = itertools.count()


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "Node | None" = None, key: list[int] | None = None, value: torch.Tensor | None = None):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key or []
        self.value = value if value is not None else torch.empty(0, dtype=torch.long)
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: "Node") -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, free_slots, enabled: bool = True):
        """free_slots: callable that returns slots to the KV pool."""
        self.free_slots = free_slots
        self.enabled = enabled
        self.root = Node()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self.hits = self.lookups = 0
        self.observer = None  # told of every insert, eviction and flush (KV events: framework/kv_events/emitter.py)

    # -- sizes -------------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -- match / insert ----------------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Node]:
        """Slots of the longest cached prefix of `key`, and the node where it ends."""
        if not self.enabled:
            return torch.empty(0, dtype=torch.long), self.root
        node, values, i = self.root, [], 0
        stamp = next(_clock)
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common_len(child.key, key[i:i + len(child.key)])
            child.last_access = stamp
            if n < len(child.key):
                child = self._split(child, n)
                values.append(child.value)
                node = child
                break
            values.append(child.value)
            node, i = child, i + n
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
        return slots, node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add key -> slots. Returns how many leading tokens were already cached (their slots in `value` are
        duplicates the caller frees); the cache takes ownership of the rest."""
        if not self.enabled:
            return 0
        node, i = self.root, 0
        stamp = next(_clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = Node(node, list(key[i:]), value[i:].clone())
                leaf.last_access = stamp
                node.children[key[i]] = leaf
                self._evictable += len(leaf.key)
                if self.observer is not None:
                    self.observer.stored(key, i)
                return i
            n = _common_len(child.key, key[i:i + len(child.key)])
            child.last_access = stamp
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        return i

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens; returns the new upper node (same lock count as child)."""
        upper = Node(child.parent, child.key[:n], child.value[:n])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        return upper

    # -- locks -------------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlocking a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, least recently used first. Returns slots freed."""
        leaves = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if self.observer is not None:
                self.observer.evicted(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry (POST /flush_cache)."""
        self.evict(self._evictable)
        if self.observer is not None and self.total_size() == 0:
            self.observer.cleared()

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    # -- request life cycle ------------------------------------------------------------------------------
    def cache_req(self, req, keep_lock: bool) -> None:
        """Hand a request's computed tokens to the cache (or back to the pool when the cache is off).

        keep_lock=False (finished or retracted): unlock and forget. keep_lock=True (a prefill chunk): the request
        keeps a lock on the tree's copy of its tokens and reads them from there.
        """
        n = req.kv_slots.shape[0]
        if not self.enabled:
            if not keep_lock:
                self.free_slots(req.kv_slots)
                req.kv_slots = req.kv_slots[:0]
            return
        tokens = req.fill_ids[:n]
        already = self.insert(tokens, req.kv_slots)
        self.free_slots(req.kv_slots[req.prefix_len:already])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None
        if not keep_lock:
            req.kv_slots, req.prefix_len = req.kv_slots[:0], 0
            return
        slots, node = self.match_prefix(tokens)
        self.inc_lock_ref(node)
        req.kv_slots, req.prefix_len, req.last_node = slots, n, node
