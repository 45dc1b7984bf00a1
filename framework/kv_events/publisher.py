"""The worker side: KV event batches on a ZMQ PUB socket, with vLLM's ``ZmqEventPublisher`` protocol.

Each batch goes out as the multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0
(per publisher: a restarted worker starts again at 0), ``payload`` the msgpack batch (events.py). The last
``buffer_steps`` batches are kept for replay: a DEALER that sends ``[b"", start_seq]`` to the ROUTER replay socket
gets ``[b"", seq, payload]`` for every kept batch from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.

Events are queued by the cache (any thread) and sent by the publisher's own thread, which takes whatever has queued
since its last send as one batch: one message per engine step under load, one per event when idle.

A subscriber that joins late needs every batch since the cache was last empty: servelab's publisher says which batch
that is (``info["cleared_seq"]``: the last batch with ``AllBlocksCleared``, 0 at start), so a router that starts in
front of a long-running worker replays from there rather than from 0 (vLLM's publisher has no such field: from 0).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from framework.kv_events.events import AllBlocksCleared, KVEvent, KVEventBatch, encode_batch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay_endpoint: str | None = "tcp://127.0.0.1:*",
                 topic: str = "", buffer_steps: int = 10_000, data_parallel_rank: int | None = None):
        """Endpoints as ZMQ binds them (``tcp://host:*`` takes a free port); ``self.endpoint`` and
        ``self.replay_endpoint`` are the addresses bound, for subscribers to connect to."""
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay goes out whole (a ROUTER drops past its high-water mark)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self._queue: queue.SimpleQueue[KVEvent | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        # where a subscriber joining now can start: the last batch that cleared the cache (0: it started empty).
        # servelab's addition to the protocol, advertised in /get_server_info (``info``, updated in place).
        self.info = {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": topic,
                     "cleared_seq": 0}
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, event: KVEvent) -> None:
        """Queue one event (thread-safe; never blocks)."""
        self._queue.put(event)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            events, stop = [], first is None
            if first is not None:
                events.append(first)
            while not stop:
                try:
                    e = self._queue.get_nowait()
                except queue.Empty:
                    break
                if e is None:
                    stop = True
                else:
                    events.append(e)
            if events:
                self._send(events)
            if stop:
                return

    def _send(self, events: list[KVEvent]) -> None:
        payload = encode_batch(KVEventBatch(time.time(), tuple(events), self.rank))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:  # a dead context at exit; subscribers resync from the sequence gap
            log.exception("kv events: sending batch %d failed", seq)
        self._buffer.append((seq, payload))
        if any(isinstance(e, AllBlocksCleared) for e in events):
            self.info["cleared_seq"] = seq

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignoring a replay request of %d frames", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
