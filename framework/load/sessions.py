"""What every load driver (HTTP, in-process, the simulator) shares about playing a workload's sessions: when a turn
is due (its session's arrival, then the previous answer plus the turn's think time), the bound on requests in flight
(workload.max_concurrency), and the one failure rule: a turn that fails ends its session, and each later turn is
recorded as failed and not sent (its prompt would hold the lost answer)."""
from __future__ import annotations

import heapq

from framework.contracts.workload import Session
from framework.core.records import RequestRecord


def not_sent(s: Session, k: int, send_s: float) -> list[RequestRecord]:
    """The records of the turns of `s` after turn k, which are not sent because turn k failed."""
    return [RequestRecord(ok=False, error=f"not sent: turn {k} of {s.sid} failed", send_s=send_s, session=s.sid,
                          turn=j) for j in range(k + 1, len(s.turns))]


class DueTurns:
    """Turns waiting to be sent: the earliest due first (in the order they became due among equal times), each
    released once it is due and fewer than `limit` requests are in flight (0: no bound)."""

    def __init__(self, sessions: list[Session], limit: int):
        self.limit = limit
        self._heap: list[tuple[float, int, Session, int]] = []
        self._seq = 0
        for s in sessions:
            self.add(s.arrival_s, s, 0)

    def add(self, due_s: float, session: Session, k: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (due_s, self._seq, session, k))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop(self, now: float, in_flight: int) -> tuple[Session, int] | None:
        """The next turn to send now, or None: nothing is due yet, or `in_flight` is at the bound."""
        if not self._heap or self._heap[0][0] > now or 0 < self.limit <= in_flight:
            return None
        _, _, session, k = heapq.heappop(self._heap)
        return session, k

    def __len__(self) -> int:
        return len(self._heap)
