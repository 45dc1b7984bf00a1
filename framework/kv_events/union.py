"""Several DP groups' KV events as one worker's: a router that does not address DP groups (``router.dp_aware`` off)
keeps one view per worker, which should hold a block while ANY of the worker's groups holds it. Passed through as
they come, one group's eviction would drop a block another group still holds. ``GroupUnion`` keeps, per block hash,
the groups that hold it, and turns each group's batch into the events of the union:

- ``BlockStored``: passed on (a block stored again is still one copy in the view);
- ``BlockRemoved``: only the blocks no other group holds;
- ``AllBlocksCleared`` of one group: the blocks only it held, as a ``BlockRemoved``; an ``AllBlocksCleared`` once no
  group holds anything.

Batches without a ``data_parallel_rank`` (a worker of one group) pass unchanged.
"""
from __future__ import annotations

from framework.kv_events.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent, KVEventBatch


class GroupUnion:
    def __init__(self):
        self.holders: dict[BlockHash, int] = {}   # block hash -> bit mask of the DP groups holding it

    def events(self, batch: KVEventBatch) -> tuple[KVEvent, ...]:
        """The events of the union that ``batch`` (one group's) makes."""
        if batch.data_parallel_rank is None:
            return batch.events
        bit, holders, out = 1 << batch.data_parallel_rank, self.holders, []
        for e in batch.events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    holders[h] = holders.get(h, 0) | bit
                out.append(e)
                continue
            if isinstance(e, BlockRemoved):
                hashes = e.block_hashes
            elif isinstance(e, AllBlocksCleared):
                hashes = [h for h, groups in holders.items() if groups & bit]
            else:
                out.append(e)
                continue
            gone = []
            for h in hashes:
                groups = holders.get(h, 0) & ~bit
                if groups:
                    holders[h] = groups
                else:
                    holders.pop(h, None)
                    gone.append(h)
            if isinstance(e, AllBlocksCleared) and not holders:
                out.append(AllBlocksCleared())
            elif gone:
                out.append(BlockRemoved(tuple(gone), getattr(e, "medium", None)))
        return tuple(out)

    def reset(self) -> None:
        """The worker's view starts over (a resync, a restart)."""
        self.holders.clear()
