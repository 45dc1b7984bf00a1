"""The in-instance DataParallelController: hands each incoming request to one DP group (under DP attention a group
is one rank; the parallelism plugin's `dispatcher()` builds it).

It runs on rank 0 of the instance (SGLang runs it as its own process in front of the DP schedulers). Plain
synchronous Python: the instance loop feeds it the groups' queue lengths once per step (`update`), and it counts the
requests it assigned since then, so a burst of arrivals within one step spreads out under `shortest_queue` too.
"""
from __future__ import annotations

import enum


class DPBalance(enum.StrEnum):
    """How the controller picks a DP group for a request (`parallel.dp_balance`); the values are the names."""
    round_robin = enum.auto()       # each group in turn (SGLang's default)
    shortest_queue = enum.auto()    # the group with the fewest requests waiting and running


POLICIES = tuple(DPBalance)


class DataParallelController:
    def __init__(self, size: int, policy: DPBalance | str = DPBalance.round_robin):
        if policy not in POLICIES:
            raise ValueError(f"parallel.dp_balance={policy!r} is not one of {', '.join(POLICIES)}")
        if size < 1:
            raise ValueError(f"a DataParallelController needs size >= 1, got {size}")
        self.size, self.policy = size, policy
        self._next = 0
        self._loads = [0] * size          # each rank's requests (waiting + running) at the last update
        self._since = [0] * size          # assigned since the last update
        self.assigned = [0] * size        # in all, for the results

    def update(self, loads: list[int]) -> None:
        """The ranks' current queue lengths (waiting + running), one per rank."""
        if len(loads) != self.size:
            raise ValueError(f"update needs one load per rank ({self.size}), got {len(loads)}")
        self._loads, self._since = list(loads), [0] * self.size

    def assign(self, pinned: int | None = None) -> int:
        """The rank for the next request. `pinned` (a request that names its rank, as SGLang's
        data_parallel_rank) wins when given."""
        if pinned is not None:
            if not 0 <= pinned < self.size:
                raise ValueError(f"dp_rank={pinned} is outside this instance's ranks 0..{self.size - 1}")
            rank = pinned
        elif self.policy == DPBalance.round_robin:
            rank, self._next = self._next, (self._next + 1) % self.size
        else:   # shortest_queue; ties go to the lowest rank
            rank = min(range(self.size), key=lambda r: (self._loads[r] + self._since[r], r))
        self._since[rank] += 1
        self.assigned[rank] += 1
        return rank
