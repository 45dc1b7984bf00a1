"""Publisher and subscriber over real ZMQ sockets on loopback: batches arrive in sequence order; a subscriber that
joined late, or missed batches, gets them from the replay socket; what cannot be replayed, and a publisher that
restarted (its sequence back at 0), void the view (``on_resync``)."""
from __future__ import annotations

import asyncio

import pytest

from framework.kv_events.events import AllBlocksCleared, BlockRemoved, KVEventBatch, encode_batch
from framework.kv_events.publisher import ZmqEventPublisher
from framework.kv_events.subscriber import KvEventSubscriber


class Sink:
    def __init__(self):
        self.hashes: list[int] = []
        self.resyncs: list[str] = []
        self.cleared = 0

    def batch(self, batch):
        self.hashes += [h for e in batch.events if not isinstance(e, AllBlocksCleared) for h in e.block_hashes]
        self.cleared += sum(isinstance(e, AllBlocksCleared) for e in batch.events)

    def resync(self, why):
        self.resyncs.append(why)


async def wait_for(cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def payload(h: int) -> bytes:
    return encode_batch(KVEventBatch(0.0, (BlockRemoved((h,)),)))


def test_live_stream_with_a_late_join_replayed():
    async def main():
        pub = ZmqEventPublisher()
        try:
            for h in range(3):  # before anyone subscribed: lost on the PUB socket, kept for replay
                pub.publish(BlockRemoved((h,)))
            await asyncio.sleep(0.2)
            sink = Sink()
            sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, sink.batch, sink.resync)
            task = asyncio.create_task(sub.run())
            await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the publisher
            for h in range(3, 8):
                pub.publish(BlockRemoved((h,)))
                await asyncio.sleep(0.01)
            await wait_for(lambda: sink.hashes[-1:] == [7])
            task.cancel()
            assert sink.hashes == list(range(8)) and not sink.resyncs
            assert sub.stats["replayed"] >= 1 and sub.stats["resyncs"] == 0  # 0..2 went out as one batch or more
        finally:
            pub.close()
    asyncio.run(main())


def test_gaps_restarts_and_bad_payloads():
    async def main():
        pub = ZmqEventPublisher(buffer_steps=4)
        try:
            for h in range(10):
                pub.publish(BlockRemoved((h,)))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)  # seq 0..9 sent; the replay buffer holds 6..9
            sink = Sink()
            sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, sink.batch, sink.resync)
            await sub.accept(5, payload(5))  # joined at 5: 0..4 are gone from the buffer
            assert len(sink.resyncs) == 1 and "cannot replay" in sink.resyncs[0] and sink.hashes == [5]
            await sub.accept(9, payload(9))  # missed 6..8: replayed from the buffer
            assert sink.hashes == [5, 6, 7, 8, 9] and len(sink.resyncs) == 1
            await sub.accept(9, payload(9))  # a duplicate
            assert sink.hashes == [5, 6, 7, 8, 9] and sub.stats["duplicates"] == 1
            await sub.accept(0, payload(100))  # the worker restarted: its counter is back at 0
            assert "restarted" in sink.resyncs[1] and sink.hashes[-1] == 100 and sub.last_seq == 0
            await sub.accept(1, b"\x93not msgpack")
            assert "does not decode" in sink.resyncs[2]
        finally:
            pub.close()
    asyncio.run(main())


def test_no_replay_socket_means_resync():
    async def main():
        sink = Sink()
        sub = KvEventSubscriber("tcp://127.0.0.1:9", None, sink.batch, sink.resync)
        await sub.accept(0, payload(1))
        await sub.accept(3, payload(4))
        assert sink.hashes == [1, 4] and len(sink.resyncs) == 1 and "1..2 were lost" in sink.resyncs[0]
    asyncio.run(main())



async def sent(pub, n: int, timeout_s: float = 10.0) -> None:
    """Until the publisher's thread has sent ``n`` batches (a sleep is not enough on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pub._seq < n:
        assert asyncio.get_running_loop().time() < deadline, f"publisher sent {pub._seq} of {n} batches"
        await asyncio.sleep(0.002)

def test_a_late_subscriber_replays_from_the_last_clear():
    async def main():
        pub = ZmqEventPublisher(buffer_steps=4)
        try:
            for h in range(6):  # one batch each: wait for every send, as the sequence numbers are asserted
                pub.publish(BlockRemoved((h,)))
                await sent(pub, h + 1)
            pub.publish(AllBlocksCleared())
            await sent(pub, 7)
            pub.publish(BlockRemoved((7,)))
            await sent(pub, 8)  # seq 0..7 sent, 6 cleared; the buffer holds 4..7
            assert pub.info["cleared_seq"] == 6
            sink = Sink()
            sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, sink.batch, sink.resync,
                                    start_seq=pub.info["cleared_seq"])
            await sub.accept(8, payload(8))  # from the clear on, all replayable: no resync
            assert not sink.resyncs and sink.hashes == [7, 8] and sink.cleared == 1
        finally:
            pub.close()
    asyncio.run(main())
