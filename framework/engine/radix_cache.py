"""A token-level radix prefix cache: SGLang v0.4.1's RadixCache (mem_cache/radix_cache.py), page size 1.

Edges hold token lists and the KV slots of those tokens. A request locks the path to its matched node (reference
counts up to the root) so that the slots it reads cannot be evicted; eviction frees the least recently used unlocked
leaves, a whole leaf at a time. The cache owns every slot in the tree; a request owns the slots it adds until they
are inserted. Access times follow SGLang's: match_prefix and insert touch the nodes they walk through (a node created
by a split counts as touched when it is created, the lower half keeps its old time), on a logical clock that stands
for SGLang's time.time().

Eviction takes the leaves in SGLang's order (least recently used first, a parent once its last child goes), but from
a heap kept as the tree changes instead of a walk over the whole tree per eviction (SGLang's `_collect_leaves`):
every leaf is pushed when it is created, touched or unlocked, and stale entries are skipped; the decisions are the
same, and a simulator's cache of tens of thousands of nodes stays cheap to evict from.
"""
from __future__ import annotations

import heapq
import itertools

import torch

from framework.engine.kv_pool import cat_slots

_clock = itertools.count()


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by list comparisons (C loops; prompts run to thousands of tokens): the whole
    overlap at once (without a copy when the lengths are equal: an edge against the key's slice of its length), else
    a bisection for the first difference."""
    n = min(len(a), len(b))
    if (a == b) if len(a) == len(b) else (a[:n] == b[:n]):
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "Node | None" = None, key: list[int] | None = None, value: torch.Tensor | None = None):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key or []
        self.value = value if value is not None else torch.empty(0, dtype=torch.int32)
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: "Node") -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, free_slots, req_to_token=None, enabled: bool = True):
        """free_slots: returns slots to the KV pool. req_to_token: the ReqToTokenPool whose rows the request
        life-cycle methods read and rewrite (not needed for the tree operations alone)."""
        self.free_slots = free_slots
        self.req_to_token = req_to_token
        self.enabled = enabled
        self.root = Node()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, Node]] = []     # (last_access, leaf) entries; an entry is stale once its node
                                                    # changed time, got a child, left the tree or got locked
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
        """Slots of the longest cached prefix of `key`, and the node where it ends (an edge matched only in part
        is split there)."""
        if not self.enabled:
            return torch.empty(0, dtype=torch.int32), self.root
        node, values, i = self.root, [], 0
        self._stamp(node)
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common_len(child.key, key[i:i + len(child.key)])
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, i = child, i + n
            self._stamp(node)
        slots = cat_slots(values) if values else torch.empty(0, dtype=torch.int32)
        return slots, node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add key -> slots. Returns how many leading tokens were already cached (their slots in `value` are
        duplicates the caller frees); the cache takes ownership of the rest."""
        if not self.enabled:
            return 0
        node, i = self.root, 0
        self._stamp(node)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = node.children[key[i]] = Node(node, list(key[i:]), value[i:].clone())
                heapq.heappush(self._heap, (leaf.last_access, leaf))
                self._evictable += len(key) - i
                if self.observer is not None:
                    self.observer.stored(key, i)
                return i
            n = _common_len(child.key, key[i:i + len(child.key)])
            if n == len(child.key) and i + n == len(key):
                return len(key)                     # ends exactly at this node: SGLang leaves its time alone
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
            self._stamp(node)
        return i

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens; returns the new upper node (same lock count as child, a fresh time)."""
        upper = Node(child.parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        return upper

    # -- locks -------------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Node) -> int:
        """Lock the path to node. Returns the change of the evictable size (<= 0)."""
        if not self.enabled:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: Node) -> int:
        """Unlock the path to node. Returns the change of the evictable size (>= 0)."""
        if not self.enabled:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlocking a node that is not locked")
            if node.lock_ref == 1:
                delta += len(node.key)
                if not node.children:                 # an evictable leaf again
                    heapq.heappush(self._heap, (node.last_access, node))
            node.lock_ref -= 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    # -- eviction ----------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, least recently used first, until at least num_tokens slots are freed or none
        is left. Returns slots freed."""
        if not self.enabled:
            return 0
        heap, freed = self._heap, 0
        while freed < num_tokens and heap:
            stamp, leaf = heapq.heappop(heap)
            if not self._evictable_leaf(leaf, stamp):
                continue
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if self.observer is not None:
                self.observer.evicted(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent))
        if len(heap) > 2 * self.total_size() + 1024:    # mostly stale entries: rebuild from the tree
            self._heap = [(n.last_access, n) for n in self._leaves() if n.lock_ref == 0]
            heapq.heapify(self._heap)
        return freed

    def _evictable_leaf(self, node: Node, stamp: int) -> bool:
        """An entry is current: its node is still in the tree, a leaf, unlocked, and not touched since."""
        return (stamp == node.last_access and not node.children and node.lock_ref == 0
                and node.parent is not None and node.parent.children.get(node.key[0]) is node)

    def _stamp(self, node: Node) -> None:
        node.last_access = next(_clock)
        if not node.children and node is not self.root:
            heapq.heappush(self._heap, (node.last_access, node))

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

    # -- request life cycle (SGLang's cache_finished_req / cache_unfinished_req) -----------------------------
    def cache_finished_req(self, req) -> None:
        """A finished (or aborted) request: its tokens with KV go into the tree, duplicates back to the pool; its
        row and its lock are released. With the cache off its KV goes back to the pool."""
        row, n = req.req_pool_idx, req.kv_len
        slots = self.req_to_token.slots(row, n)
        if self.enabled:
            already = self.insert(req.fill_ids[:n], slots)
            self.free_slots(slots[len(req.prefix_indices):already])
            self.dec_lock_ref(req.last_node)
        else:
            self.free_slots(slots)
        self.req_to_token.free(row)
        req.release_kv()

    def cache_unfinished_req(self, req) -> None:
        """After a prefill (or a prefill chunk): publish the request's tokens at once, point its row at the tree's
        copy of them and move its lock to the new node. With the cache off the request keeps its own slots."""
        row, n = req.req_pool_idx, req.kv_len
        slots = self.req_to_token.slots(row, n)
        if not self.enabled:
            req.prefix_indices = slots
            return
        tokens = req.fill_ids[:n]
        already = self.insert(tokens, slots.clone())
        old = len(req.prefix_indices)
        self.free_slots(slots[old:already].clone())
        new_indices, node = self.match_prefix(tokens)
        self.req_to_token.write(row, old, new_indices[old:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.prefix_indices, req.last_node = new_indices, node
