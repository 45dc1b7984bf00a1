"""The router side: one ZMQ SUB per worker endpoint, batches handed on in sequence order, and a resync when the
sequence says something was lost.

For each message ``[topic, seq, payload]``:
- the next ``seq``: decoded and handed to ``on_batch``;
- a gap (``seq`` past the next one, or a first message past ``start_seq``: the subscriber joined late): the missing
  batches are asked from the worker's replay socket; when it still holds all of them they are handed on first, else the view of
  that worker is void (``on_resync``: the caller drops it) and the stream goes on from ``seq``;
- ``seq`` below the last one: the publisher restarted (its counter starts at 0) and its cache with it: ``on_resync``,
  then the same as a first message;
- the same ``seq`` again: dropped.
A payload that does not decode is a loss too (``on_resync``). ``stats`` counts each case.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from typing import Callable

import zmq
import zmq.asyncio

from framework.kv_events.events import KvEventError, KVEventBatch, decode_batch
from framework.kv_events.publisher import END_SEQ

RESTARTED, EVENTS_LOST = "restarted", "events_lost"  # why a view is void (the routing contract's reset causes)

log = logging.getLogger(__name__)


class KvEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None, on_batch: Callable[[KVEventBatch], None],
                 on_resync: Callable[..., None], topic: str = "", replay_timeout_s: float = 1.0,
                 name: str = "", start_seq: int = 0):
        """``start_seq``: the first batch a view needs (the publisher's last clear, when it says; else 0).
        ``on_resync(why)``, or ``on_resync(why, cause)`` when it takes a second argument: ``RESTARTED`` (the sequence
        went back: a new publisher) or ``EVENTS_LOST``."""
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.start_seq = start_seq
        self.on_batch, self.on_resync = on_batch, on_resync
        self.replay_timeout_s = replay_timeout_s
        self.name = name or endpoint
        self.last_seq: int | None = None
        self.stats: Counter[str] = Counter()  # batches, events, replayed, resyncs, restarts, decode_errors
        self._ctx = zmq.asyncio.Context.instance()
        try:
            self._takes_cause = len(inspect.signature(on_resync).parameters) >= 2
        except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
            self._takes_cause = False

    async def run(self) -> None:
        """Receive until cancelled (ZMQ reconnects by itself; the sequence numbers tell what a reconnect lost)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._resync(f"a message of {len(frames)} frames is not [topic, seq, payload]")
                    continue
                await self.accept(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close()

    async def accept(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq == last:
            self.stats["duplicates"] += 1
            return
        if last is not None and seq < last:
            self.stats["restarts"] += 1
            self._resync(f"sequence went back from {last} to {seq}: the worker restarted", RESTARTED)
            last, self.start_seq = None, 0  # a new publisher, a cache that started empty
        expected = self.start_seq if last is None else last + 1
        if seq > expected:
            missed = await self._replay(expected, seq)
            if missed is None:
                self._resync(f"batches {expected}..{seq - 1} were lost and the worker cannot replay them")
            else:
                self.stats["replayed"] += len(missed)
                for s, p in missed:
                    self._apply(s, p)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KvEventError as e:
            self.stats["decode_errors"] += 1
            self._resync(f"batch {seq} does not decode: {e}")
            return
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        self.on_batch(batch)

    def _resync(self, why: str, cause: str = EVENTS_LOST) -> None:
        self.stats["resyncs"] += 1
        log.warning("kv events from %s: %s; its cache view starts over", self.name, why)
        if self._takes_cause:
            self.on_resync(why, cause)
        else:
            self.on_resync(why)

    async def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]] | None:
        """Batches ``start..stop-1`` from the replay socket, or None when it has not got every one of them."""
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.replay_endpoint)
        got: dict[int, bytes] = {}
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 3 or frames[1] == END_SEQ:
                    break
                seq = int.from_bytes(frames[1], "big")
                if start <= seq < stop:
                    got[seq] = frames[2]
        except TimeoutError:
            log.warning("kv events from %s: the replay socket did not answer in %.1f s", self.name,
                        self.replay_timeout_s)
            return None
        finally:
            sock.close()
        if len(got) != stop - start:
            return None
        return sorted(got.items())
