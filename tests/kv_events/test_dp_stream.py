"""One worker's stream carrying several DP groups' KV events (a multi-rank instance's, as its rank 0 forwards them):
each batch keeps its group's data_parallel_rank through a real publisher and subscriber, and a subscriber that joins
late starts at the oldest of the groups' last clears (a clear of one group leaves the other's earlier batches needed).
A router that sees the worker whole merges the groups' events (a block stays while any group holds it). Also: a cache
observed again by the same emitter (the DP controller re-checks before each decision) tells it once."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from framework.kv_events.emitter import Tee, observe
from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from framework.kv_events.publisher import ZmqEventPublisher
from framework.kv_events.subscriber import KvEventSubscriber
from framework.kv_events.union import GroupUnion


def sent(pub: ZmqEventPublisher, batch: KVEventBatch) -> int:
    """Publish ``batch`` alone and return its sequence number once it went out."""
    before = pub.info["last_seq"]
    pub.publish_batch(batch)
    deadline = time.monotonic() + 5
    while pub.info["last_seq"] == before:
        assert time.monotonic() < deadline, "the publisher did not send"
        time.sleep(0.005)
    return pub.info["last_seq"]


def test_a_late_subscriber_gets_every_groups_batches_since_the_oldest_clear():
    async def main():
        pub = ZmqEventPublisher()
        try:
            rank = lambda r, *events: KVEventBatch(0.0, events, r)  # noqa: E731
            sent(pub, rank(0, BlockRemoved((1,))))
            sent(pub, rank(1, BlockRemoved((2,))))
            clear0 = sent(pub, rank(0, AllBlocksCleared()))
            assert pub.info["cleared_seq"] == 0        # group 1 never cleared: its first batch is still needed
            sent(pub, rank(0, BlockRemoved((3,))))
            sent(pub, rank(1, AllBlocksCleared()))
            assert pub.info["cleared_seq"] == clear0   # both cleared since: from the older of the two clears
            last = sent(pub, rank(1, BlockRemoved((4,))))
            got: list[tuple[int | None, tuple]] = []
            sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint,
                                    lambda b: got.append((b.data_parallel_rank, b.events)), lambda why: None,
                                    start_seq=pub.info["cleared_seq"])
            task = asyncio.create_task(sub.run())
            await asyncio.sleep(0.3)                   # the SUB socket's subscription reaches the publisher
            pub.publish_batch(rank(0, BlockRemoved((5,))))
            for _ in range(500):
                if sub.last_seq == last + 1:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            assert got == [(0, (AllBlocksCleared(),)), (0, (BlockRemoved((3,)),)), (1, (AllBlocksCleared(),)),
                           (1, (BlockRemoved((4,)),)), (0, (BlockRemoved((5,)),))]
        finally:
            pub.close()
    asyncio.run(main())


def test_batches_of_one_group_queued_together_go_out_as_one_and_groups_stay_apart():
    pub = ZmqEventPublisher()
    try:
        runs = pub._runs([KVEventBatch(0.0, (BlockRemoved((1,)),), 1), KVEventBatch(0.0, (BlockRemoved((2,)),), 1),
                          KVEventBatch(0.0, (BlockRemoved((3,)),), 0), BlockRemoved((4,))])
        assert runs == [(1, [BlockRemoved((1,)), BlockRemoved((2,))]), (0, [BlockRemoved((3,))]),
                        (None, [BlockRemoved((4,))])]   # a bare event: the publisher's own rank (none here)
    finally:
        pub.close()


class Counting:
    def __init__(self):
        self.cleared_calls = 0

    def cleared(self) -> None:
        self.cleared_calls += 1


def test_observing_again_adds_no_second_delivery():
    cache, first, second = SimpleNamespace(observer=None), Counting(), Counting()
    observe(cache, first)
    observe(cache, second)
    chain = cache.observer
    for _ in range(3):
        observe(cache, first)
        observe(cache, second)
    assert cache.observer is chain and isinstance(chain, Tee)
    cache.observer.cleared()
    assert (first.cleared_calls, second.cleared_calls) == (1, 1)


def test_a_worker_seen_whole_holds_a_block_while_any_of_its_groups_does():
    union = GroupUnion()
    stored = lambda *hashes: BlockStored(hashes, None, tuple(range(len(hashes))), 1)  # noqa: E731
    batch = lambda rank, *events: KVEventBatch(0.0, events, rank)  # noqa: E731
    assert union.events(batch(0, stored(1, 2, 3))) == (stored(1, 2, 3),)
    assert union.events(batch(1, stored(1, 2))) == (stored(1, 2),)
    assert union.events(batch(1, BlockRemoved((2,)))) == ()                  # group 0 still holds block 2
    assert union.events(batch(0, BlockRemoved((2, 3)))) == (BlockRemoved((2, 3)),)
    assert union.events(batch(0, AllBlocksCleared())) == ()                  # block 1: group 1 holds it too
    assert union.events(batch(1, AllBlocksCleared())) == (AllBlocksCleared(),)
    one_group = KVEventBatch(0.0, (BlockRemoved((9,)),), None)
    assert union.events(one_group) == one_group.events                       # a worker of one group: as it comes
    union.events(batch(0, stored(4)))
    assert union.events(batch(1, AllBlocksCleared())) == ()                  # group 1 held nothing: 4 stays
