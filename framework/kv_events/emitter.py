"""The radix cache's KV events: which full blocks became cached and which stopped being so.

servelab's RadixCache keeps token ranges with page size 1; vLLM's events speak of full blocks of ``block_size``
tokens. A block (its tokens and every token before it) is cached when the cache holds the path to its last token, so:

- an insert that adds a leaf for ``key[start:]`` (``key[:start]`` was cached already) stores the blocks that end in
  ``(start, len(key)]``: ``BlockStored`` with their chained hashes, chained on the block before the first of them;
- an evicted leaf covering tokens ``[start, end)`` of its path takes away every block that ends in ``(start, end]``
  (a block that straddles ``start`` loses its tail): ``BlockRemoved``;
- a flush that leaves the cache empty: ``AllBlocksCleared``.

The cache calls the three methods of ``CacheEventEmitter`` (its ``observer``) as it changes; the emitter hands each
event to ``sink`` (the publisher), which batches whatever arrived since its last send. Hashes are
``hashing.chain_hashes``, computed from the path's tokens each time (no state shared with the cache).
"""
from __future__ import annotations

from typing import Callable, Sequence

from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from framework.kv_events.hashing import chain_hashes


class CacheEventEmitter:
    def __init__(self, block_size: int, sink: Callable[[KVEvent], None]):
        if block_size < 1:
            raise ValueError(f"kv events block_size must be >= 1, got {block_size}")
        self.block_size, self.sink = block_size, sink

    def stored(self, key: Sequence[int], start: int) -> None:
        """``key`` is cached now; its first ``start`` tokens were already."""
        b = self.block_size
        first, end = start // b, len(key) // b  # blocks first..end-1 end inside (start, len(key)]
        if first >= end:
            return
        hashes = chain_hashes(key[:end * b], b)
        self.sink(BlockStored(tuple(hashes[first:]), hashes[first - 1] if first else None,
                              tuple(key[first * b:end * b]), b))

    def evicted(self, leaf) -> None:
        """``leaf`` (a cache node: ``key``, ``parent``; the root's parent is None) is about to leave the cache."""
        parts, node = [], leaf
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        path = [t for part in reversed(parts) for t in part]
        b = self.block_size
        first, end = (len(path) - len(leaf.key)) // b, len(path) // b
        if first < end:
            self.sink(BlockRemoved(tuple(chain_hashes(path[:end * b], b)[first:])))

    def cleared(self) -> None:
        self.sink(AllBlocksCleared())


class Tee:
    """A radix cache observer that tells two observers (e.g. the router's publisher and the DP controller's view)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def stored(self, key, start) -> None:
        self.first.stored(key, start)
        self.second.stored(key, start)

    def evicted(self, leaf) -> None:
        self.first.evicted(leaf)
        self.second.evicted(leaf)

    def cleared(self) -> None:
        self.first.cleared()
        self.second.cleared()


def _tells(obs, emitter) -> bool:
    """Whether observer ``obs`` (perhaps a chain of ``Tee``s) already tells ``emitter``."""
    if isinstance(obs, Tee):
        return _tells(obs.first, emitter) or _tells(obs.second, emitter)
    return obs is emitter


def observe(cache, emitter) -> None:
    """Make ``emitter`` one of ``cache``'s observers, beside whatever observers it has (``Tee``s), once: asked again
    (the DP controller re-checks before each decision) it adds nothing."""
    obs = cache.observer
    if _tells(obs, emitter):
        return
    cache.observer = emitter if obs is None else Tee(obs, emitter)
