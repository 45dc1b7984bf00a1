"""The worker side: KV event batches on a ZMQ PUB socket, with vLLM's ``ZmqEventPublisher`` protocol.

Each batch goes out as the multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0
(per publisher: a restarted worker starts again at 0), ``payload`` the msgpack batch (events.py). The last
``buffer_steps`` batches are kept for replay: a DEALER that sends ``[b"", start_seq]`` to the ROUTER replay socket
gets ``[b"", seq, payload]`` for every kept batch from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.

Events are queued by the cache (any thread) and sent by the publisher's own thread, which takes whatever has queued
since its last send as one batch: one message per engine step under load, one per event when idle. A multi-rank
instance's events come already batched per DP group (``publish_batch``: each with its ``data_parallel_rank``, as its
rank 0 forwards them); consecutive ones of the same group go out as one message, so one stream carries every group.

A subscriber that joins late needs every batch since the cache was last empty: servelab's publisher says which batch
that is (``info["cleared_seq"]``: the last batch with ``AllBlocksCleared``, 0 at start; with several DP groups on
one stream, the oldest of the groups' last clears), so a router that starts in front of a long-running worker replays
from there rather than from 0 (vLLM's publisher has no such field: from 0).
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
        self._queue: queue.SimpleQueue[KVEvent | KVEventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._cleared: dict[int | None, int] = {}    # DP rank -> its last batch that cleared its cache (0: none)
        # where a subscriber joining now can start: the last batch that cleared the cache (0: it started empty).
        # servelab's addition to the protocol, advertised in /get_server_info (``info``, updated in place).
        # ``last_seq``: the last batch sent (-1: none yet), for a client that waits until a router has seen it all
        self.info = {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": topic,
                     "cleared_seq": 0, "last_seq": -1}
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, event: KVEvent) -> None:
        """Queue one event (thread-safe; never blocks)."""
        self._queue.put(event)

    def publish_batch(self, batch: KVEventBatch) -> None:
        """Queue a batch that keeps its own ``data_parallel_rank`` (a DP group's; thread-safe; never blocks)."""
        self._queue.put(batch)

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
            items, stop = [], first is None
            if first is not None:
                items.append(first)
            while not stop:
                try:
                    e = self._queue.get_nowait()
                except queue.Empty:
                    break
                if e is None:
                    stop = True
                else:
                    items.append(e)
            for rank, events in self._runs(items):
                self._send(events, rank)
            if stop:
                return

    def _runs(self, items: list) -> list[tuple[int | None, list[KVEvent]]]:
        """The queued items as (DP rank, events) runs, in order: a bare event is this publisher's rank's."""
        runs: list[tuple[int | None, list[KVEvent]]] = []
        for item in items:
            rank, events = (item.data_parallel_rank, item.events) if isinstance(item, KVEventBatch) else \
                (self.rank, (item,))
            if runs and runs[-1][0] == rank:
                runs[-1][1].extend(events)
            elif events:
                runs.append((rank, list(events)))
        return runs

    def _send(self, events: list[KVEvent], rank: int | None) -> None:
        payload = encode_batch(KVEventBatch(time.time(), tuple(events), rank))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:  # a dead context at exit; subscribers resync from the sequence gap
            log.exception("kv events: sending batch %d failed", seq)
        self._buffer.append((seq, payload))
        # per DP group: a clear of one group leaves the others' earlier batches needed, so a late subscriber starts
        # at the oldest of the groups' last clears (a group never cleared: 0)
        self._cleared[rank] = seq if any(isinstance(e, AllBlocksCleared) for e in events) else \
            self._cleared.get(rank, 0)
        self.info["cleared_seq"] = min(self._cleared.values())
        self.info["last_seq"] = seq

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
