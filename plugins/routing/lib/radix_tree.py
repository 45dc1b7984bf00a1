"""The cache-aware router's approximate radix tree: ONE tree over raw request text shared by every worker.

Each node holds an edge of text and, per tenant (worker), a stamp: the last time a text sent to it ended at that node
(or created it). A node's last access -- the last time a text through it was sent to the tenant, what SGLang stamps
on every node of the path -- is the newest stamp of the tenant in its subtree; the request path stamps only the
deepest node and its parent (two dict writes instead of one per node of the path), and eviction, which takes a node only once the
tenant holds nothing below it, carries each evicted stamp up to the parent, so it meets every node with its last
access all the same. A tree built with ``stamp_path=True`` stamps every node of the path, as SGLang does, for a caller
that reads the last access of inner nodes (the ``most_recent`` tie break). The tree keeps two invariants: a tenant on a node is on every ancestor (it was sent the whole prefix), and every non-root
node has at least one tenant. ``tenant_size(t)`` counts the characters of the nodes holding ``t`` (= the distinct
non-empty prefixes of the texts sent to ``t``) and is kept up to date on every change, never recomputed by a walk.

Eviction (LRU per tenant, SGLang's ``evict_tenant_data``) pops (last access, node) entries, oldest first, from a queue
per tenant filled on insert; entries go stale when the node is touched again or dropped and are skipped when popped,
so the request path only pays one append and eviction never walks the tree. Stale entries are dropped once they
outnumber the live ones (checked in O(1) at every insert), so the queues stay bounded by the tree; and a tree built
with ``max_tenant_chars`` evicts a tenant that passes it (by 1/32) at the insert that did it, so the tree itself stays
bounded whatever the request rate between two periodic ``evict`` passes.

``undo_insert`` takes back an insert whose request never reached the worker (the router's attempt failed).

The module name starts with ``_`` so that the routing registry does not take it for a plugin key.
"""
from __future__ import annotations

import heapq
from collections import deque

_MASK64 = 2**64 - 1

QUEUE_SLACK = 1024  # stale LRU entries tolerated beyond the live ones before the queues are compacted
INSERT_EVICTION_SLACK_DIV = 32  # a tenant may pass its bound by 1/32 before an insert evicts it back down


class Node:
    __slots__ = ("text", "children", "tenants", "parent", "end", "serial")

    def __init__(self, text: str, parent: "Node | None", end: int, serial: int = 0):
        self.text = text
        self.serial = serial  # creation order in its tree: a stable identity (tie breaks hash it)
        self.children: dict[str, Node] = {}  # first character of the child's text -> child
        self.tenants: dict[str, float] = {}  # tenant -> last access time
        self.parent = parent  # None for the root and for nodes that were dropped
        self.end = end  # characters from the root to the end of this node's text


class _LruQueue:
    """A tenant's (stamp, node) entries, popped oldest first. Stamps mostly arrive in order (a monotonic clock), so a
    deque takes them in O(1); the few that do not (parents queued during eviction, a clock that went back) go to a
    small heap. Equal stamps pop in arrival order."""
    __slots__ = ("fifo", "late", "seq")

    def __init__(self) -> None:
        self.fifo: deque[tuple[float, Node]] = deque()
        self.late: list[tuple[float, int, Node]] = []
        self.seq = 0

    def __len__(self) -> int:
        return len(self.fifo) + len(self.late)

    def push(self, stamp: float, node: Node) -> None:
        fifo = self.fifo
        if not fifo or stamp >= fifo[-1][0]:
            fifo.append((stamp, node))
        else:
            self.seq += 1
            heapq.heappush(self.late, (stamp, self.seq, node))

    def oldest_stamp(self) -> float | None:
        fifo, late = self.fifo, self.late
        if late and (not fifo or late[0][0] < fifo[0][0]):
            return late[0][0]
        return fifo[0][0] if fifo else None

    def pop(self) -> tuple[float, Node]:
        fifo, late = self.fifo, self.late
        if late and (not fifo or late[0][0] < fifo[0][0]):
            stamp, _, node = heapq.heappop(late)
            return stamp, node
        return fifo.popleft()

    def keep_only(self, tenant: str) -> None:
        """Drop the entries already stale: node dropped, or the tenant's stamp on it changed."""
        self.fifo = deque(e for e in self.fifo if e[1].parent is not None and e[1].tenants.get(tenant) == e[0])
        self.late = [e for e in self.late if e[2].parent is not None and e[2].tenants.get(tenant) == e[0]]
        heapq.heapify(self.late)


def _common_prefix_len(text: str, pos: int, edge: str) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``edge``, known to share at least the first character."""
    lo, hi = 1, min(len(edge), len(text) - pos)
    while lo < hi:  # invariant: text[pos:] starts with edge[:lo]; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    def __init__(self, max_tenant_chars: int | None = None, stamp_path: bool = False):
        """``max_tenant_chars``: the bound each tenant is evicted down to at insert time, once it passes it by
        1/INSERT_EVICTION_SLACK_DIV (None: only explicit ``evict`` calls bound the tree). ``stamp_path``: stamp every
        node of an inserted text's path (each node's stamp is then its last access), not only the deepest."""
        self.max_tenant_chars = max_tenant_chars
        self.stamp_path = stamp_path
        self._evict_above = (float("inf") if max_tenant_chars is None else
                             max_tenant_chars + max_tenant_chars // INSERT_EVICTION_SLACK_DIV)
        self.root = Node("", None, 0)
        self.node_count = 0  # non-root nodes
        self.total_chars = 0  # characters stored once, whatever the number of tenants
        self._sizes: dict[str, int] = {}
        self._queues: dict[str, _LruQueue] = {}
        self._serial = 0  # nodes created so far
        self._queued = 0  # entries in every queue together
        self._compact_at = QUEUE_SLACK  # compact the queues when _queued passes this

    # -- queries -----------------------------------------------------------------------------------------------------
    def walk(self, text: str) -> tuple[int, Node]:
        """(matched characters, deepest node reached). When the match ends inside a node's text, that node is returned
        and ``matched < node.end``: every tenant on it was sent the whole matched prefix."""
        node = self.root
        pos, n = 0, len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.text
            if not text.startswith(edge, pos):
                return pos + _common_prefix_len(text, pos, edge), child
            pos = child.end
            node = child
        return pos, node

    def match(self, text: str) -> tuple[int, dict[str, float], Node]:
        """(longest prefix of ``text`` sent to any tenant, {tenant: stamp} of the tenants that were sent all of it --
        empty when nothing matched; read only; the last accesses with ``stamp_path`` --, the node the match ended on)."""
        matched, node = self.walk(text)
        return matched, node.tenants, node

    def tenant_size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._sizes)

    # -- updates -----------------------------------------------------------------------------------------------------
    def insert(self, text: str, tenant: str, now: float) -> int:
        matched, node = self.walk(text)
        return self.insert_at(text, matched, node, tenant, now)

    def insert_at(self, text: str, matched: int, node: Node, tenant: str, now: float) -> int:
        """Record that ``text`` was sent to ``tenant`` at ``now``, continuing from ``walk(text)`` (which must be its
        result on the unchanged tree). Returns how many characters of ``text`` the tenant held before."""
        root = self.root
        if node is not root and matched < node.end:
            node = self._split(node, matched)
        size = self._sizes.get(tenant, 0)
        n = len(text)
        end_node = node
        if matched < n:
            self._serial += 1
            end_node = Node(text[matched:], node, n, self._serial)
            end_node.tenants[tenant] = now
            node.children[text[matched]] = end_node
            size += n - matched
            self.node_count += 1
            self.total_chars += n - matched
        held = 0
        cur = node
        while cur is not root:  # the tenant joins the nodes it was missing from (stamped now)
            tenants = cur.tenants
            if tenant in tenants:  # the deepest node it already held: so does every ancestor
                held = cur.end
                if cur is node:  # the text passed through or ended here (a queued entry of it is stale now)
                    tenants[tenant] = now
                if self.stamp_path:
                    while cur is not root:
                        cur.tenants[tenant] = now
                        cur = cur.parent
                break
            tenants[tenant] = now
            size += len(cur.text)
            cur = cur.parent
        self._sizes[tenant] = size
        if end_node is not root:
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = _LruQueue()
            queue.push(now, end_node)
            self._queued += 1
            if self._queued > self._compact_at:
                self.compact_queues()
        if size > self._evict_above:
            self.evict_tenant(tenant, self.max_tenant_chars)
        return held

    def undo_insert(self, text: str, tenant: str, held: int, stamp: float) -> int:
        """Take back ``insert(text, tenant, stamp)``, which returned ``held``: the tenant leaves the nodes of the
        text's path beyond ``held`` characters, deepest first, while they still carry ``stamp`` (a later insert
        re-credited the others) and it holds no deeper node. Returns the characters it lost."""
        node, pos, n, path = self.root, 0, len(text), []
        while pos < n:
            child = node.children.get(text[pos])
            if child is None or not text.startswith(child.text, pos):
                break  # the rest of the path was dropped since (evicted, tenant removed)
            pos += len(child.text)
            node = child
            if node.end > held:
                path.append(node)
        lost = 0
        for node in reversed(path):
            tenants = node.tenants
            if tenants.get(tenant) != stamp or any(tenant in c.tenants for c in node.children.values()):
                break
            del tenants[tenant]
            lost += len(node.text)
            if not tenants:  # no tenant implies no child (ancestor invariant)
                self._unlink(node)
        if lost:
            self._sizes[tenant] -= lost
        return lost

    def _unlink(self, node: Node) -> None:
        """Drop a node that has no tenant (hence no child) from the tree."""
        del node.parent.children[node.text[0]]
        node.parent = None
        self.node_count -= 1
        self.total_chars -= len(node.text)

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` so that a new parent ends at ``at`` characters; the new parent holds the same tenants."""
        keep = at - (node.end - len(node.text))
        parent = node.parent
        self._serial += 1
        upper = Node(node.text[:keep], parent, at, self._serial)
        upper.tenants = dict(node.tenants)
        node.text = node.text[keep:]
        node.parent = upper
        upper.children[node.text[0]] = node
        parent.children[upper.text[0]] = upper
        self.node_count += 1
        return upper

    def evict(self, max_chars_per_tenant: int) -> int:
        """Drop each tenant's least recently used leaves until it holds at most ``max_chars_per_tenant`` characters.
        A node left with no tenant is removed. Returns the tenant-characters evicted."""
        evicted = sum(self.evict_tenant(t, max_chars_per_tenant) for t in list(self._sizes))
        self.compact_queues()
        return evicted

    def evict_tenant(self, tenant: str, max_chars: int) -> int:
        """``evict`` for one tenant (the bound checked at insert time): its LRU leaves go until it holds at most
        ``max_chars``. Returns the characters evicted."""
        size = self._sizes.get(tenant, 0)
        if size <= max_chars:
            return 0
        evicted = 0
        root = self.root
        queue = self._queues.get(tenant)
        while queue and size > max_chars:
            stamp, node = queue.pop()
            self._queued -= 1
            while True:
                tenants = node.tenants
                if node.parent is None or tenants.get(tenant) != stamp:
                    break  # stale: dropped, evicted, or touched since (a newer entry exists if it is a leaf)
                if node.children and any(tenant in c.tenants for c in node.children.values()):
                    break  # not a leaf for this tenant; it is queued again when its last such child goes
                del tenants[tenant]
                length = len(node.text)
                size -= length
                evicted += length
                parent = node.parent
                if not tenants:
                    self._unlink(node)
                if parent is root:
                    break
                parent_stamp = parent.tenants[tenant]  # its last access is the newest stamp that was below it
                if stamp > parent_stamp:
                    parent.tenants[tenant] = parent_stamp = stamp
                siblings = parent.children
                if siblings and any(tenant in c.tenants for c in siblings.values()):
                    break
                # The parent became a leaf for this tenant: take it next if it is the oldest, else queue it.
                if size > max_chars:
                    oldest = queue.oldest_stamp()
                    if oldest is None or parent_stamp <= oldest:
                        node, stamp = parent, parent_stamp
                        continue
                queue.push(parent_stamp, parent)
                self._queued += 1
                break
        self._sizes[tenant] = size
        return evicted

    def compact_queues(self) -> None:
        """Drop the stale entries once there are more than live ones (plus a slack); the next compaction waits until
        the queues have doubled again, so its cost is amortised over the inserts that made it necessary."""
        if self._queued <= self._compact_at:
            return
        for tenant, queue in self._queues.items():
            queue.keep_only(tenant)
        self._queued = sum(map(len, self._queues.values()))
        self._compact_at = 2 * self._queued + QUEUE_SLACK

    def remove_tenant(self, tenant: str) -> None:
        """Forget ``tenant`` everywhere; nodes left with no tenant are removed. Only its own subtree is walked."""
        self._sizes.pop(tenant, None)
        queue = self._queues.pop(tenant, None)
        self._queued -= len(queue) if queue else 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                tenants = child.tenants
                if tenant not in tenants:
                    continue  # ancestor invariant: nothing below holds it either
                del tenants[tenant]
                if tenants:
                    stack.append(child)
                else:  # nothing below holds any tenant: drop the whole subtree
                    del node.children[key]
                    self._drop_subtree(child)

    def _drop_subtree(self, top: Node) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            node.parent = None
            self.node_count -= 1
            self.total_chars -= len(node.text)
            stack.extend(node.children.values())


def mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of an int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
