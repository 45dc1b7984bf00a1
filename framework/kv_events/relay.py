"""A DP group's KV events on their way out of its rank: to the instance's DP controller
(``parallel.dp_balance=precise``) or to the worker process that publishes them to routers
(``InstanceSpec.kv_events_block_size``).

Under DP attention each rank holds its own radix cache, and the controller and the channel to the worker are on rank
0. The leader of every other DP group keeps its cache's events here and hands them over once per step, as one
``KVEventBatch`` stamped with its ``data_parallel_rank`` (vLLM's field for the same purpose); the instance loop
carries the batch to rank 0 in the step's control exchange (framework/instance/rank_loop.py), which happens anyway,
so the forward never waits for it. (Rank 0's own group drains its relay straight into the outbox to the worker.)
"""
from __future__ import annotations

import time

from framework.kv_events.emitter import CacheEventEmitter, observe
from framework.kv_events.events import KVEvent, KVEventBatch


class EventRelay:
    def __init__(self, cache, block_size: int, dp_rank: int | None):
        """``dp_rank``: the stamp of its batches (None: an instance of one group, as vLLM leaves it out)."""
        self.dp_rank = dp_rank
        self._events: list[KVEvent] = []
        observe(cache, CacheEventEmitter(block_size, self._events.append))

    def drain(self) -> list[KVEventBatch]:
        """The events since the last drain as one batch (none when nothing changed)."""
        if not self._events:
            return []
        batch = KVEventBatch(time.time(), tuple(self._events), self.dp_rank)
        self._events.clear()
        return [batch]
