"""The radix cache's events describe its full blocks exactly. Oracle: after every insert, eviction and flush of a real
RadixCache, the blocks the events say are cached (stored minus removed) are the chained hashes of every full block of
every path in the tree, computed by brute force from the tree's token paths."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from framework.kv_events.hashing import chain_hashes


def cached_blocks(cache: RadixCache, block_size: int) -> set[int]:
    out, stack = set(), [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        out.update(chain_hashes(path, block_size))
        stack.extend((child, path + child.key) for child in node.children.values())
    return out


class Follower:
    """What a subscriber learns from the events alone."""

    def __init__(self):
        self.blocks: set[int] = set()

    def __call__(self, event) -> None:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert event.parent_block_hash is None or event.parent_block_hash in self.blocks  # chained on a known one
            assert chain_hashes(event.token_ids, event.block_size, event.parent_block_hash) == list(event.block_hashes)
            assert not self.blocks & set(event.block_hashes), "a block stored twice"
            self.blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= self.blocks, "a block removed that was not stored"
            self.blocks.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.blocks.clear()


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
    st.tuples(st.just("evict"), st.integers(1, 10)),
    st.tuples(st.just("flush"), st.just(None)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), ops)
def test_events_follow_the_cache_block_for_block(block_size, sequence):
    cache = RadixCache(lambda slots: None)
    follower = Follower()
    cache.observer = CacheEventEmitter(block_size, follower)
    for op, arg in sequence:
        if op == "insert":
            cache.insert(arg, torch.arange(len(arg)))
        elif op == "evict":
            cache.evict(arg)
        else:
            cache.reset()
        assert follower.blocks == cached_blocks(cache, block_size)


def test_a_flush_ends_with_all_blocks_cleared():
    events = []
    cache = RadixCache(lambda slots: None)
    cache.observer = CacheEventEmitter(2, events.append)
    cache.insert([1, 2, 3, 4, 5], torch.arange(5))
    cache.insert([1, 2, 9, 9], torch.arange(4))
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert events[1].parent_block_hash == events[0].block_hashes[0] and events[1].token_ids == (9, 9)
    cache.reset()
    assert isinstance(events[-1], AllBlocksCleared)
