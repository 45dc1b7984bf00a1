"""The exact view of the workers' caches that the token policies share (precise_prefix, kv_cost): which full blocks
each worker holds, learnt from its KV events (framework/kv_events), and the blocks the router expects it to hold.

A block is keyed by ``BlockKeys`` (chained over the block's tokens, so a request's blocks and an event's meet whatever
hash the worker publishes): an event's ``BlockStored`` chains its blocks on the key of its parent block, found through
the worker's own hash of it. A worker holds a block, as far as a decision is concerned, while its count in
``_held[worker]`` is positive. The count adds up three things:

- stored: one per event that stored the block and no event removed since (``_by_events``, the exact part);
- in flight: one per request routed there with the block and not ended (``credit`` at the decision): without it, two
  requests with a new prefix sent a moment apart scatter, since the first's blocks are not stored yet;
- recent: one per request that ended there with the block, until the worker's event for it arrives or
  ``confirm_s`` passes (``retire``; ``expire`` drops the old ones): the answer can reach the router before the
  worker's events do, and the session's next request follows at once. A block the worker stored and then removed
  while the request was in flight is not awaited: its events came already, and it is gone.

A decision's estimate (``matched_chars``) counts all three, as the match does; ``confirmed_prefix`` (the router's
``policy_accuracy`` figure ``confirmed_tokens``) counts stored and recent blocks only: a request in flight may be
prefilled alongside the next one rather than before it. In-flight and recent credits are
servelab's addition (docs/routing.md); ``pending_credit=false`` turns both off.

What it remembers follows the workers' caches: a flush (``AllBlocksCleared``), a restart or a lost stream drops a
worker's stored blocks and recent credits (``forget``), a flush or a restart its capacity estimate too, a removal
everything (``drop_credits``). Two figures describe a cache rather than hold it: ``capacity_blocks`` (the most blocks its events
showed at once) and ``stored_total`` (how much it stored lately: its turnover). The turnover ages: every count halves
each time the workers together have stored as many blocks as their caches hold (a full turnover of the cluster), so
it tells how fast each cache turns over now, not over the router's lifetime; a flush starts that worker's count over
(and the count towards the next halving: after every worker was flushed the view is a fresh router's).

A match is a binary search, not a walk: where a worker's blocks are prefix-closed (each block it holds, its parent
too), it holds the first k blocks of a request exactly when it holds block k-1, so ~log2(blocks) probes find its
longest match. Closure breaks where a worker lacks a block under one it holds (its gaps: a prefix evicted while a
request that extends it is in flight, a flush under requests in flight, a cache that evicts a block before its
children). The first gap on a request's path bounds the search (above it the path's blocks are prefix-closed), so a
match stays exact at ~log2(blocks) probes plus one per candidate gap. The gaps of a worker's stored and recent blocks
are kept as they change (``_conf_gaps``: from each such block's parent and depth, ``_parent``, and the number of such
children of each block, ``_conf_children``), off the request path: events and ends. A request in flight adds a chain
(its blocks past those its worker held, each the parent of the next), which can open a gap only at its first block's
parent: the view keeps those parents with their depth (``_starts``: a key names one path, so one depth) and, as the
worker's counts change, the ones it lacks (``_missing``: empty as a rule), and a match checks the gaps and those
against the path. So a decision credits its blocks in one C-level count update (``Counter.update``'s core, or the C
table's ``add``) and one entry for its chain, with no per-block index work; the stored-or-recent index also answers
``confirmed_prefix``.

Per worker, ``_held[worker]`` counts each block's stored, in-flight and recent credits together (one table per worker,
probed once per step of a search): a Counter, or with the C keys the C table (``BlockCounts``: 64-bit words in one
array, which the C search probes and a credit fills without making an int per block).
"""
from __future__ import annotations

from array import array
from collections import Counter, deque
from typing import Sequence

from framework.kv_events.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from framework.kv_events.hashing import ROOT_HASH, BlockCounts, BlockKeys, held_prefixes

try:
    from _collections import _count_elements  # CPython's C loop behind Counter.update, without its Python-level checks
except ImportError:  # another Python: the same loop in Python
    def _count_elements(counts, keys):
        get = counts.get
        for key in keys:
            counts[key] = get(key, 0) + 1


_EMPTY: dict = {}  # (read only) a worker with none


class KvView:
    def __init__(self, block_size: int, confirm_s: float = 2.0, native: bool | None = None):
        self.block_size, self.confirm_s = block_size, confirm_s
        self.keys = BlockKeys(block_size, native)  # native: the C keys and search (hashing.py), when built
        # a worker's counts: a Counter, or with the C keys the C table (``BlockCounts``), and how a credit adds to them;
        # the view uses only what both do ([], []=, del, in, len: the C table does not iterate)
        self._counts, self._add = (BlockCounts, BlockCounts.add) if self.keys.native else (Counter, _count_elements)
        self._held: dict[str, Counter | BlockCounts] = {}  # worker -> block key -> stored + in flight + recent
        self._external: dict[str, dict[BlockHash, int]] = {}  # worker -> its own block hash -> our key
        self._by_events: dict[str, dict[int, int]] = {}  # worker -> key -> events that stored it
        self._recent: dict[str, dict[int, int]] = {}  # worker -> key -> ended requests awaiting its event
        self._deadlines: deque[tuple[float, str, int]] = deque()  # (when a recent credit lapses, worker, key)
        # worker -> key -> the removal count when an event removed it while credits were left on it (``retire``)
        self._removed_at: dict[str, dict[int, int]] = {}
        self.removals = 0  # removals so far: a request's credit remembers the count at its decision
        self._peak: dict[str, int] = {}  # worker -> the most blocks its events showed it holding at once
        self._stored_total: dict[str, float] = {}  # worker -> blocks stored lately, aged: how fast its cache turns over
        self._stored_since_aging = 0  # blocks stored by every worker since the counts last halved
        # the index that turns a match into a binary search (module docstring): for each block some worker holds
        # stored or recent, its parent's key (ROOT_HASH: a first block) and its depth (0: a first block), and on how
        # many workers it is so; per worker, how many of those children each block has, and its gaps (key -> depth)
        self._parent: dict[int, tuple[int, int]] = {}
        self._refs: dict[int, int] = {}
        self._conf_children: dict[str, dict[int, int]] = {}
        self._conf_gaps: dict[str, dict[int, int]] = {}
        # worker -> the parent key of an in-flight chain's first block -> [its depth, chains in flight there], and
        # those parents the worker does not hold now (kept as its counts change): a match reads only these, none as a
        # rule (a subset test of every parent against the counts at each decision probed ~16 cold entries a worker)
        self._starts: dict[str, dict[int, list[int]]] = {}
        self._missing: dict[str, set[int]] = {}
        self.stats = {"stored": 0, "removed": 0, "cleared": 0, "orphans": 0, "unknown_removed": 0, "confirmed": 0,
                      "lapsed": 0}

    # -- events ------------------------------------------------------------------------------------------------------
    def apply(self, worker: str, event) -> None:
        if isinstance(event, BlockStored):
            self._store(worker, event)
        elif isinstance(event, BlockRemoved):
            ext = self._external.get(worker, {})
            for h in event.block_hashes:
                key = ext.pop(h, None)
                if key is None:
                    self.stats["unknown_removed"] += 1
                else:
                    self._unstore(worker, key)
                    self.stats["removed"] += 1
        elif isinstance(event, AllBlocksCleared):
            self.forget(worker, capacity=True)
            self.stats["cleared"] += 1

    def _store(self, worker: str, e: BlockStored) -> None:
        b = self.block_size
        if e.block_size != b:
            raise ValueError(f"worker {worker} publishes blocks of {e.block_size} tokens; this policy's "
                             f"router.block_size is {b}: set it to the workers' block size")
        if len(e.token_ids) != len(e.block_hashes) * b:
            raise ValueError(f"worker {worker}: a BlockStored of {len(e.block_hashes)} blocks carries "
                             f"{len(e.token_ids)} tokens, not {len(e.block_hashes) * b}")
        ext = self._external.setdefault(worker, {})
        if e.parent_block_hash is None:
            parent, depth = ROOT_HASH, 0
        else:
            parent = ext.get(e.parent_block_hash)
            if parent is None:  # stored on a block the view never saw: unreachable from a request's first block
                self.stats["orphans"] += len(e.block_hashes)
                return
            depth = self._parent[parent][1] + 1  # stored there: in the index
        stored, recent = self._by_events.setdefault(worker, {}), self._recent.get(worker)
        held = self._held_by(worker)
        removed_at = self._removed_at.get(worker)
        new = 0
        missing = self._missing.get(worker)
        for h, key in zip(e.block_hashes, self.keys.chain(e.token_ids, parent)):
            above, parent, depth = parent, key, depth + 1
            if h in ext:
                continue  # stored again without a removal in between: still one copy
            ext[h] = key
            new += 1
            held[key] += 1
            if missing and key in missing:  # a chain's parent is back
                missing.discard(key)
            n = stored.get(key, 0)
            stored[key] = n + 1
            if not n and not (recent and key in recent):
                self._confirmed(worker, key, True, above, depth - 1)
            if removed_at:
                removed_at.pop(key, None)
            self.stats["stored"] += 1
            if recent and recent.get(key):  # the event an ended request was waiting for
                self._take(recent, key)
                self._drop(worker, key)
                self.stats["confirmed"] += 1
        self._stored_total[worker] = self._stored_total.get(worker, 0) + new
        if len(stored) > self._peak.get(worker, 0):  # only grew above: its size once it has filled
            self._peak[worker] = len(stored)
        self._stored_since_aging += new
        if self._stored_since_aging >= sum(self._peak.values()):  # the caches turned over once: age the counts
            self._stored_since_aging = 0
            totals = self._stored_total
            for w in totals:
                totals[w] /= 2

    def _unstore(self, worker: str, key: int) -> None:
        stored = self._by_events[worker]
        self._take(stored, key)
        if key not in stored and key not in self._recent.get(worker, ()):
            self._confirmed(worker, key, False)
        self._drop(worker, key)
        self.removals += 1
        if key in self._held.get(worker, ()):  # credited to requests in flight: ``retire`` must not await it
            self._removed_at.setdefault(worker, {})[key] = self.removals

    def forget(self, worker: str, capacity: bool = False) -> None:
        """Drop what the events said of ``worker`` and what it was expected to hold after its requests ended (the
        credits of its requests in flight stay with them); its turnover starts over (an empty cache keeps what it
        is given longest), and so does the aging's count; ``capacity``: its capacity estimate too (learnt again as
        it fills: the router cannot tell a flush from a restart with another size)."""
        for key in self._external.pop(worker, {}).values():
            self._unstore(worker, key)
        self._by_events.pop(worker, None)
        self._removed_at.pop(worker, None)
        for key, n in self._recent.pop(worker, {}).items():
            self._unref(key)  # nothing stored is left: it leaves the worker's stored-or-recent set
            for _ in range(n):
                self._drop(worker, key)
        self._conf_children.pop(worker, None)  # nothing stored or recent is left of it
        self._conf_gaps.pop(worker, None)
        self._stored_total.pop(worker, None)
        self._stored_since_aging = 0
        if capacity:
            self._peak.pop(worker, None)

    def drop_credits(self, worker: str) -> None:
        """Drop every credit of ``worker`` and every figure of its cache (removed: the ends of its requests will not
        be reported)."""
        self.forget(worker, capacity=True)
        self._held.pop(worker, None)
        self._starts.pop(worker, None)
        self._missing.pop(worker, None)

    def cached_blocks(self, worker: str) -> int:
        return len(self._by_events.get(worker, ()))

    def stored_total(self, worker: str) -> float:
        """Blocks ``worker``'s events have stored lately (since its last flush, halved at each turnover of the
        workers' caches): with caches of one size, the one that stored the fewest turns over slowest, and keeps a new
        prefix longest."""
        return self._stored_total.get(worker, 0)

    def sizes(self) -> dict[str, int]:
        """Entries per structure (``RoutingPolicy.state_sizes``)."""
        return {"view_blocks": sum(map(len, self._held.values())),
                "view_worker_hashes": sum(map(len, self._external.values())),
                "view_recent": sum(map(len, self._recent.values())), "view_deadlines": len(self._deadlines),
                "view_removed_at": sum(map(len, self._removed_at.values())), "view_parents": len(self._parent),
                "view_child_counts": sum(map(len, self._conf_children.values())),
                "view_chains": sum(map(len, self._starts.values())),
                "view_chain_gaps": sum(map(len, self._missing.values()))}

    def capacity_blocks(self, worker: str) -> int:
        """The most blocks ``worker``'s events showed it holding at once: its cache's size, once it has filled."""
        return self._peak.get(worker, 0)

    def holds(self, worker: str, key: int) -> bool:
        """Whether ``worker`` holds the block (stored, in flight or recent)."""
        return key in self._held.get(worker, ())

    # -- requests ----------------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], candidates: list[str], hint: int | None = None,
              hints: dict[str, int] | None = None) -> dict[str, int]:
        """Per candidate, how many leading blocks of ``keys`` it holds (stored, in flight or recent). ``hint``: a likely
        answer (the length of the prompt the request continues), tried first; then ``hints``' own guess for the
        candidate (its answer for that prompt), then the previous candidate's answer (a shared prefix). Hints cost
        probes, never change an answer. C keys (an ``array('Q')``) are searched in C, without hints
        (``held_prefixes``: the same answers)."""
        all_held, all_gaps, all_missing = self._held, self._conf_gaps, self._missing
        irregular = all_gaps or all_missing  # some worker has a gap or a chain lacking its parent (none, as a rule)
        if type(keys) is array:
            if type(candidates) is not list:
                candidates = list(candidates)
            bounds = None
            if irregular:
                n, bounds = len(keys), {}
                for w in candidates:
                    held = all_held.get(w)
                    if held and (all_gaps.get(w) or all_missing.get(w)):
                        hi = self._bound(w, keys, held, n)
                        if hi < n:
                            bounds[w] = hi
            return held_prefixes(keys, all_held, candidates, bounds)
        n = len(keys)
        matched, last = {}, -1  # -1: no guess (below any search's range)
        first = keys[0] if n else None
        hint = -1 if hint is None else hint
        for w in candidates:
            held = all_held.get(w)
            if not held or first not in held:  # none of it (most candidates, as a rule): one probe, no search
                matched[w] = last = 0
                continue
            lo, hi = 1, n  # it holds the first lo blocks, not the first hi + 1 (no gap is at depth 0: it holds that)
            if irregular:
                hi = self._bound(w, keys, held, hi)
            # the guesses (hint, the candidate's own, the previous candidate's): at most 2 probes each, each narrows
            if lo < hi:
                own = hints.get(w) if hints else None
                for guess in (hint, -1 if own is None else own, last):
                    if lo <= guess <= hi:
                        if keys[guess - 1] not in held:  # (guess >= lo >= 1)
                            hi = guess - 1
                        elif guess < hi:
                            if keys[guess] in held:
                                lo = guess + 1
                            else:
                                lo = hi = guess
                        else:
                            lo = guess
                        if lo == hi:  # settled: the usual case after one
                            break
                else:
                    if lo > 1:  # a guess was held, and more past it: the worker the prompt it continues went to, which
                        step = 1  # holds that prompt's answer too, a few blocks: gallop from there, then search
                        while lo + step <= hi:
                            if keys[lo + step - 1] in held:
                                lo += step
                                step <<= 1
                            else:
                                hi = lo + step - 1
                                break
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if keys[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            matched[w] = last = lo
        return matched

    def _bound(self, worker: str, keys: Sequence[int], held: Counter | BlockCounts, hi: int) -> int:
        """At most ``hi`` leading blocks of ``keys``, and fewer when ``worker`` has a gap on their path: a block it lacks
        right above one it holds, or the missing parent of one of its chains in flight."""
        gaps = self._conf_gaps.get(worker)
        if gaps:
            for key, depth in gaps.items():
                if depth < hi and keys[depth] == key and key not in held:
                    hi = depth
        missing = self._missing.get(worker)
        if missing:
            starts = self._starts[worker]
            for key in missing:
                depth = starts[key][0]
                if depth < hi and keys[depth] == key:
                    hi = depth
        return hi

    def confirmed_prefix(self, worker: str, keys: Sequence[int], upto: int) -> int:
        """How many of the first ``upto`` of ``keys`` ``worker`` holds stored or recent (in-flight credits aside)."""
        stored, recent = self._by_events.get(worker, _EMPTY), self._recent.get(worker, _EMPTY)
        lo, hi = 0, upto
        gaps = self._conf_gaps.get(worker)
        if gaps:
            hi = min(hi, _below_gaps(keys, gaps.items(), (), len(keys)))
        if hi:  # the common case: all of it
            key = keys[hi - 1]
            if key in stored or key in recent:
                return hi
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            key = keys[mid - 1]
            if key in stored or key in recent:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def credit(self, worker: str, keys: Sequence[int], parent: int, depth: int) -> None:
        """A request's blocks (a chain: each the parent of the next, the first a child of ``parent`` at ``depth``) are
        in flight on ``worker``: one count each (a C-level update), and the chain's start, where it can open a gap."""
        if not keys:
            return
        held = self._held.get(worker)
        if held is None:
            held = self._held[worker] = self._counts()
        self._add(held, keys)  # a C loop either way (Counter.update's core without its checks, or the C table's)
        missing = self._missing.get(worker)
        if missing:  # (rare) a missing parent of another chain may be among the blocks credited now
            missing.difference_update([key for key in missing if key in held])
        if depth:
            starts = self._starts.get(worker)
            if starts is None:
                starts = self._starts[worker] = {}
            start = starts.get(parent)
            if start is None:
                starts[parent] = [depth - 1, 1]
                if parent not in held:  # (the match found it held, as a rule)
                    self._missing.setdefault(worker, set()).add(parent)
            else:
                start[1] += 1

    def debit(self, worker: str, keys: Sequence[int], parent: int, depth: int) -> None:
        """A request credited with these blocks (``credit``'s arguments) failed there."""
        for key in keys:
            self._drop(worker, key)
        self._end_chain(worker, keys, parent, depth)

    def retire(self, worker: str, keys: Sequence[int], parent: int, depth: int, now: float, since: int) -> None:
        """A request credited with these blocks (``credit``'s arguments) when ``removals`` was ``since`` ended there:
        each credit stays (recent) until the worker's event for the block arrives or ``confirm_s`` passes; one already
        stored goes now, and so does one stored and removed again since the decision (gone, not late)."""
        stored = self._by_events.get(worker, {})
        if keys and all(map(stored.__contains__, keys)):  # the usual end: its events came first (a C-level test)
            held = self._held[worker]
            for key in keys:  # stored and credited: counted twice at least, so never down to 0 here
                held[key] -= 1
            self._end_chain(worker, keys, parent, depth)
            return
        recent = self._recent.setdefault(worker, {})
        removed_at = self._removed_at.get(worker, {})
        deadline = now + self.confirm_s
        above = parent
        for i, key in enumerate(keys, depth):
            if key in stored:
                self._drop(worker, key)
            elif removed_at.get(key, 0) > since:
                self._drop(worker, key)
                if key not in self._held.get(worker, ()):  # no credit left to retire: forget the removal
                    del removed_at[key]
            else:
                n = recent.get(key, 0)
                recent[key] = n + 1
                if not n:  # not stored either (above)
                    self._confirmed(worker, key, True, above, i)
                self._deadlines.append((deadline, worker, key))
            above = key
        self._end_chain(worker, keys, parent, depth)

    def expire(self, now: float) -> None:
        """Drop the recent credits whose event did not come within ``confirm_s`` (evicted meanwhile, or lost)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, worker, key = deadlines.popleft()
            recent = self._recent.get(worker)
            if recent and recent.get(key):  # else confirmed (or forgotten) already
                self._take(recent, key)
                if key not in recent and key not in self._by_events.get(worker, ()):
                    self._confirmed(worker, key, False)
                self._drop(worker, key)
                self.stats["lapsed"] += 1

    # -- counts ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _take(counts: dict[int, int], key: int) -> None:
        if counts[key] == 1:
            del counts[key]
        else:
            counts[key] -= 1

    def _held_by(self, worker: str) -> Counter | BlockCounts:
        held = self._held.get(worker)
        if held is None:
            held = self._held[worker] = self._counts()
        return held

    def _drop(self, worker: str, key: int) -> None:
        held = self._held[worker]  # (an emptied worker's counter stays: one per worker)
        n = held[key] - 1
        if n:
            held[key] = n
        else:
            del held[key]
            starts = self._starts.get(worker)
            if starts and key in starts:  # a chain in flight there now lacks its parent
                self._missing.setdefault(worker, set()).add(key)

    def _end_chain(self, worker: str, keys: Sequence[int], parent: int, depth: int) -> None:
        if not keys or not depth:
            return
        starts = self._starts[worker]
        start = starts[parent]
        if start[1] == 1:
            del starts[parent]
            if not starts:
                del self._starts[worker]
            missing = self._missing.get(worker)
            if missing is not None:
                missing.discard(parent)
                if not missing:
                    del self._missing[worker]
        else:
            start[1] -= 1

    def _unref(self, key: int) -> None:
        """One worker fewer holds ``key`` stored or recent."""
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]
            del self._parent[key]

    def _confirmed(self, worker: str, key: int, now: bool, parent: int = ROOT_HASH, depth: int = 0) -> None:
        """``key`` turned stored-or-recent on ``worker`` (``now``: a child of ``parent`` at ``depth``), or stopped being
        either: keep the worker's gaps (a block is a gap while it is out of the set and one of its children is in)."""
        if now:
            n = self._refs.get(key, 0)
            self._refs[key] = n + 1
            if not n:
                self._parent[key] = (parent, depth)
        children = self._conf_children.get(worker)
        if children is None:
            children = self._conf_children[worker] = {}
        all_gaps = self._conf_gaps
        gaps = all_gaps.get(worker)
        parent, depth = self._parent[key]
        if parent != ROOT_HASH:
            n = children.get(parent, 0)
            if now:
                children[parent] = n + 1
                if not n and not self._confirms(worker, parent):
                    if gaps is None:
                        gaps = all_gaps[worker] = {}
                    gaps[parent] = depth - 1
            elif n == 1:
                del children[parent]
                if gaps:
                    gaps.pop(parent, None)
            else:
                children[parent] = n - 1
        if now:
            if gaps:
                gaps.pop(key, None)
        else:
            if key in children:
                if gaps is None:
                    gaps = all_gaps[worker] = {}
                gaps[key] = depth
            self._unref(key)
        if gaps is not None and not gaps:
            del all_gaps[worker]
        if not children:
            del self._conf_children[worker]

    def _confirms(self, worker: str, key: int) -> bool:
        return key in self._by_events.get(worker, ()) or key in self._recent.get(worker, ())


def _below_gaps(keys: Sequence[int], gaps, held, first: int) -> int:
    """The depth of the shallowest of ``gaps`` ((key, depth) pairs) on the path ``keys`` that is not in ``held``
    (``first``: none above it): above it, the worker's blocks on the path are prefix-closed."""
    for key, depth in gaps:
        if depth < first and keys[depth] == key and key not in held:
            first = depth
    return first
