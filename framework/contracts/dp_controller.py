"""The in-instance DataParallelController: hands each incoming request to one DP group (under DP attention a group
is one rank; the parallelism plugin's `dispatcher()` builds it).

It runs on rank 0 of the instance (SGLang runs it as its own process in front of the DP schedulers). Plain
synchronous Python: the instance loop feeds it the groups' queue lengths once per step (`update`), and it counts the
requests it assigned since then, so a burst of arrivals within one step spreads out under `shortest_queue` too.

SGLang v0.4's controller is prefix-blind (round_robin, shortest_queue). Two servelab switches see each group's radix
cache, with the rule of SGLang's router (sgl-router's cache_aware): when the groups' loads are imbalanced (max - min
> `balance_abs_threshold` and max > min x `balance_rel_threshold`) the shortest queue; else the group whose cache
matches most of the prompt (the least loaded among equals) when it matches more than `cache_threshold` of it; else
the group with the most room (cache_aware: the smallest tree; precise: the shortest queue).

- `cache_aware`: an approximate view per group, as the router keeps per worker: the prompts it sent there, as chains
  of block hashes (framework/kv_events/hashing.py), forgotten least-recently-used past `tree_max_tokens`.
- `precise`: the exact view: each group's radix cache publishes its KV events (framework/kv_events/emitter.py) into
  the controller, which keeps the blocks each group holds, as a router following KV events does per worker. A cache
  in the controller's process is watched directly (`watch`: rank 0's own group, every group in the simulator); a
  group on another rank relays its events (`relay` on that rank, `feed` here: framework/kv_events/relay.py), carried
  to rank 0 by the step's control exchange, so they arrive a step late and the forward never waits for them.

A request that names its group (`pinned`: SGLang's data_parallel_rank; a router that addresses DP groups itself)
goes there under every policy.
"""
from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from framework.kv_events.emitter import CacheEventEmitter, observe
from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from framework.kv_events.relay import EventRelay
from framework.kv_events.hashing import chain_hashes

log = logging.getLogger(__name__)


class DPBalance(enum.StrEnum):
    """How the controller picks a DP group for a request (`parallel.dp_balance`); the values are the names."""
    round_robin = enum.auto()       # each group in turn (SGLang's default)
    shortest_queue = enum.auto()    # the group with the fewest requests waiting and running
    cache_aware = enum.auto()       # servelab: an approximate prefix view per group (the router's rule)
    precise = enum.auto()           # servelab: the exact view from each group's KV events


POLICIES = tuple(DPBalance)
PREFIX_POLICIES = (DPBalance.cache_aware, DPBalance.precise)


@dataclass(frozen=True)
class PrefixRule:
    """The prefix-aware policies' knobs (sgl-router's defaults)."""
    block_size: int = 16               # tokens per hashed block of the views
    cache_threshold: float = 0.5       # the best match must cover more than this share of the prompt
    balance_abs_threshold: int = 32    # loads imbalanced when max - min exceeds this ...
    balance_rel_threshold: float = 1.0001   # ... and max exceeds min times this
    tree_max_tokens: int = 1 << 22     # cache_aware: tokens each group's approximate view remembers


class BlockView:
    """One group's blocks as a view holds them (the subclasses decide how they come and go)."""
    blocks: OrderedDict[int, None] | set[int]

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt's chain the group holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def size(self) -> int:
        return len(self.blocks)


class ApproxView(BlockView):
    """One group's prompts as the controller sent them: block hashes, least recently used first."""

    def __init__(self, max_blocks: int):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.max_blocks = max_blocks

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class EventView(BlockView):
    """One group's cached blocks, from its KV events (the emitter's sink)."""

    def __init__(self):
        self.blocks: set[int] = set()

    def __call__(self, event) -> None:
        if isinstance(event, BlockStored):
            self.blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.blocks.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()


class DataParallelController:
    def __init__(self, size: int, policy: DPBalance | str = DPBalance.round_robin, rule: PrefixRule = PrefixRule()):
        if policy not in POLICIES:
            raise ValueError(f"parallel.dp_balance={policy!r} is not one of {', '.join(POLICIES)}")
        if size < 1:
            raise ValueError(f"a DataParallelController needs size >= 1, got {size}")
        if rule.block_size < 1 or not 0 <= rule.cache_threshold <= 1:
            raise ValueError(f"dp_balance's block size must be >= 1 and its cache threshold in [0, 1], got {rule}")
        self.size, self.policy, self.rule = size, policy, rule
        self._next = 0
        self._loads = [0] * size          # each rank's requests (waiting + running) at the last update
        self._since = [0] * size          # assigned since the last update
        self.assigned = [0] * size        # in all, for the results
        self.prefix_hits = 0              # requests a prefix-aware policy sent to their best match
        self.views: list = ([ApproxView(max(1, rule.tree_max_tokens // rule.block_size)) for _ in range(size)]
                            if policy == DPBalance.cache_aware else
                            [EventView() for _ in range(size)] if policy == DPBalance.precise else [])
        self._watched: list = [None] * size   # precise: each group's radix cache and the emitter it feeds
        self._fed = [False] * size            # precise: groups whose events arrive as relayed batches (`feed`)
        self._warned = False

    def update(self, loads: list[int]) -> None:
        """The ranks' current queue lengths (waiting + running), one per rank."""
        if len(loads) != self.size:
            raise ValueError(f"update needs one load per rank ({self.size}), got {len(loads)}")
        self._loads, self._since = list(loads), [0] * self.size

    def watch(self, rank: int, cache) -> None:
        """Follow DP group `rank`'s radix cache through its KV events (policy precise; the others ignore it). The
        controller's emitter joins whatever observer the cache has (a `Tee`), now and whenever one replaces it."""
        if self.policy == DPBalance.precise:
            self._watched[rank] = (cache, CacheEventEmitter(self.rule.block_size, self.views[rank]))
            self._rewire()

    def _rewire(self) -> None:
        for entry in self._watched:
            if entry is not None:
                observe(*entry)

    def relay(self, rank: int, cache) -> EventRelay | None:
        """The other side of `watch` for a DP group whose cache lives in another process (rank `rank`'s leader):
        its KV events, batched for `feed` (policy precise; None for the others)."""
        if self.policy != DPBalance.precise:
            return None
        return EventRelay(cache, self.rule.block_size, rank)

    def feed(self, batch: KVEventBatch) -> None:
        """A batch of KV events from the group its `data_parallel_rank` names (an `EventRelay`'s)."""
        rank = batch.data_parallel_rank
        if self.policy != DPBalance.precise:
            return
        if rank is None or not 0 <= rank < self.size:
            raise ValueError(f"a KV event batch for the DP controller names its group 0..{self.size - 1} in "
                             f"data_parallel_rank, got {rank!r}")
        self._fed[rank] = True
        for event in batch.events:
            self.views[rank](event)

    def assign(self, pinned: int | None = None, prompt_ids: Sequence[int] | None = None) -> int:
        """The rank for the next request. `pinned` (a request that names its rank, as SGLang's
        data_parallel_rank) wins when given; the prefix-aware policies read `prompt_ids`."""
        if pinned is not None:
            if not 0 <= pinned < self.size:
                raise ValueError(f"dp_rank={pinned} is outside this instance's ranks 0..{self.size - 1}")
            rank = pinned
        elif self.policy == DPBalance.round_robin:
            rank, self._next = self._next, (self._next + 1) % self.size
        elif self.policy in PREFIX_POLICIES and prompt_ids is not None:
            rank = self._by_prefix(prompt_ids)
        else:   # shortest_queue (and a prefix policy given no prompt); ties go to the lowest rank
            rank = self._shortest()
        if self.policy == DPBalance.cache_aware and prompt_ids is not None:
            self.views[rank].insert(chain_hashes(prompt_ids, self.rule.block_size))
        self._since[rank] += 1
        self.assigned[rank] += 1
        return rank

    def _load(self, r: int) -> int:
        return self._loads[r] + self._since[r]

    def _shortest(self) -> int:
        return min(range(self.size), key=lambda r: (self._load(r), r))

    def _by_prefix(self, prompt_ids: Sequence[int]) -> int:
        rule = self.rule
        if self.policy == DPBalance.precise:
            if not any(self._watched) and not any(self._fed):
                if not self._warned:
                    log.warning("parallel.dp_balance=precise: no DP group's KV events reach this controller (neither "
                                "`watch` nor `feed` was called): the shortest queue decides")
                    self._warned = True
                return self._shortest()
            self._rewire()
        loads = [self._load(r) for r in range(self.size)]
        lo, hi = min(loads), max(loads)
        if hi - lo > rule.balance_abs_threshold and hi > lo * rule.balance_rel_threshold:
            return self._shortest()
        hashes = chain_hashes(prompt_ids, rule.block_size)
        matched = [view.match(hashes) for view in self.views]
        best = min(range(self.size), key=lambda r: (-matched[r], loads[r], r))
        if hashes and matched[best] * rule.block_size > rule.cache_threshold * len(prompt_ids):
            self.prefix_hits += 1
            return best
        if self.policy == DPBalance.cache_aware:   # the most room: the smallest view
            return min(range(self.size), key=lambda r: (self.views[r].size(), loads[r], r))
        return self._shortest()
