"""`router.dp_aware=true`: the router addresses the DP groups of its workers itself (sgl-router's `--dp-aware`;
llm-d's experimental DP-aware wide EP), instead of leaving the choice to each instance's DP controller.

`DPAware` wraps the routing policy. To the router core it is the policy over the workers; to the policy it wraps,
each worker of `dp_size` DP groups is `dp_size` candidates named as sgl-router names them, `{url}@{rank}`. So any
policy keeps its view per (worker, DP rank): cache_aware a tree per group, a KV-event policy the exact blocks of each
group. The decision's `memo` says which rank won (`dp_rank_of`); the driver sends the request to the worker with that
rank (the HTTP router: the X-Data-Parallel-Rank header; the simulator: the instance's pin), and the instance's DP
controller serves it there.

What the workers tell reaches the right candidate:
- KV events as whole `KVEventBatch`es: each batch's `data_parallel_rank` (vLLM's field) names its group; a batch
  without one is rank 0's (vLLM's publisher leaves it out for a single rank);
- a bare KV event (a one-group worker's): rank 0;
- a `RankReset` (one rank's stream of a worker that publishes per rank lost batches it cannot replay, or restarted):
  that group's view only;
- a `LoadReport` (the instance's sum): split evenly over its groups, the first groups one more when it does not divide.

P/D (sglang's PD router with `--dp-aware` as fixed in sgl-project/sglang#26245): each role's policy is wrapped as well
(framework/routing/pairs.py `role_policies`), sharing what the router learnt of each worker's dp_size (`learnt`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

from framework.contracts.routing import LoadReport, RequestUsage, RequestView, RoutingDecision, RoutingPolicy
from framework.kv_events.events import KVEventBatch

DP_RANK_HEADER = "X-Data-Parallel-Rank"   # how the HTTP router names the chosen group (the worker reads it as the
                                          # body's data_parallel_rank, which sglang-router sends: no re-encoding)


class RankReset(NamedTuple):
    """A worker event: what the policy knew of DP group `rank`'s cache is void (`cause`: a contract reset cause)."""
    rank: int
    cause: str


class DPChoice(NamedTuple):
    """A DP-aware decision's `memo`: the DP rank chosen and the wrapped policy's own decision."""
    rank: int
    decision: RoutingDecision


def dp_target(url: str, rank: int) -> str:
    """sgl-router's name for DP rank `rank` of worker `url` under --dp-aware."""
    return f"{url}@{rank}"


def dp_rank_of(decision: RoutingDecision | None) -> int | None:
    """The DP rank a DP-aware decision chose (None: the router does not address DP groups)."""
    memo = None if decision is None else decision.memo
    return memo.rank if isinstance(memo, DPChoice) else None


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (r < n % parts) for r in range(parts)]


class DPAware(RoutingPolicy):
    def __init__(self, inner: RoutingPolicy, dp_size: Callable[[str], int], alongside: "DPAware | None" = None):
        """`dp_size(url)`: how many DP groups worker `url` has (asked when it is added, unless `set_dp_size` said it
        before: `learnt`, which the wrappers made `alongside` one another share, so a worker moving into its role's
        policy keeps its groups)."""
        self.inner, self._dp_size = inner, dp_size
        self.learnt: dict[str, int] = {} if alongside is None else alongside.learnt
        self._sharing = weakref.WeakSet() if alongside is None else alongside._sharing   # the live wrappers sharing it
        self._sharing.add(self)
        self.Config, self.Reasons = inner.Config, inner.Reasons
        self.subscriptions, self.keeps_estimate = inner.subscriptions, inner.keeps_estimate
        self.sizes: dict[str, int] = {}          # worker -> its DP groups
        self._known: dict[str, int] = {}         # set_dp_size's answer, for the re-add it makes
        super().__init__(inner.cfg, inner.seed)

    # the router core sets the policy's clock: the wrapped one keeps the same time
    @property
    def clock(self) -> Callable[[], float]:
        return self.inner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.inner.clock = clock

    @property
    def accuracy(self):
        return self.inner.accuracy

    def targets(self, url: str) -> list[str]:
        return [dp_target(url, r) for r in range(self.sizes[url])]

    def alongside(self, inner: RoutingPolicy) -> "DPAware":
        """``inner`` wrapped as this policy is, sharing what it learnt of each worker's dp_size (a P/D router's role
        policies: a worker moving into its role's policy keeps its groups)."""
        return DPAware(inner, self._dp_size, self)

    # -- workers -----------------------------------------------------------------------------------------------------
    def _worker_added(self, worker: str) -> None:
        n = self._known.pop(worker, None) or self.learnt.get(worker) or self._dp_size(worker)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"router.dp_aware=true: worker {worker} must have dp_size >= 1, got {n!r}")
        self.sizes[worker] = n
        for t in self.targets(worker):
            self.inner.add_worker(t)

    def _worker_removed(self, worker: str) -> None:
        for t in self.targets(worker):
            self.inner.remove_worker(t)
        del self.sizes[worker]

    def set_dp_size(self, worker: str, n: int) -> None:
        """Worker `worker` turned out to have `n` DP groups (the HTTP router learns it from its /server_info): its
        candidates change; the old ones' requests in flight end without reaching the wrapped policy."""
        self._require_known(worker)
        self.learnt[worker] = n
        if n == self.sizes[worker]:
            return
        self._worker_removed(worker)
        self._known[worker] = n
        self._worker_added(worker)

    def set_healthy(self, worker: str, healthy: bool = True) -> None:
        super().set_healthy(worker, healthy)
        for t in self.targets(worker):
            self.inner.set_healthy(t, healthy)

    def _worker_reset(self, worker: str, cause: str) -> None:
        for t in self.targets(worker):
            self.inner.reset_worker(t, cause)

    # -- requests ----------------------------------------------------------------------------------------------------
    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        self.inner.role = self.role
        target = self.inner.select(request, [t for url in candidates for t in self.targets(url)])
        d = self.inner.last_decision
        url, _, rank = target.rpartition("@")
        return RoutingDecision(url, d.matched_chars, d.request_chars, d.reason, d.text, d.at, DPChoice(int(rank), d))

    def on_request_done(self, worker: str, decision: RoutingDecision | None = None, ok: bool = True,
                        usage: RequestUsage | None = None) -> None:
        known = worker in self.loads
        super().on_request_done(worker, None, ok, usage)   # the worker's count; the wrapped policy settles the rest
        if known and isinstance(getattr(decision, "memo", None), DPChoice):
            self.inner.on_request_done(dp_target(worker, decision.memo.rank), decision.memo.decision, ok, usage)

    def hold_s(self, decision: RoutingDecision) -> float:
        memo = decision.memo
        return self.inner.hold_s(memo.decision) if isinstance(memo, DPChoice) else 0.0

    # -- what the workers tell ---------------------------------------------------------------------------------------
    def on_worker_event(self, worker: str, event: Any) -> None:
        if worker not in self.loads:
            return
        n = self.sizes[worker]
        if isinstance(event, KVEventBatch):
            rank = event.data_parallel_rank or 0
            if not 0 <= rank < n:
                raise ValueError(f"worker {worker} sent KV events of DP rank {rank}; it has ranks 0..{n - 1}")
            for e in event.events:
                self.inner.on_worker_event(dp_target(worker, rank), e)
        elif isinstance(event, RankReset):
            if 0 <= event.rank < n:
                self.inner.reset_worker(dp_target(worker, event.rank), event.cause)
        elif isinstance(event, LoadReport):
            for t, *parts in zip(self.targets(worker), *(_split(v, n) for v in event)):
                self.inner.on_worker_event(t, LoadReport(*parts))
        else:
            self.inner.on_worker_event(dp_target(worker, 0), event)

    def maintain(self, now: float | None = None) -> None:
        """The wrapped policy's periodic work; and `learnt` forgets the workers no sharing wrapper holds any more (a
        worker removed for good; one re-added later asks for its dp_size again), so it stays as large as the pool."""
        self.inner.maintain(now)
        gone = [url for url in self.learnt if not any(url in p.sizes for p in self._sharing)]
        for url in gone:
            del self.learnt[url]

    def state_sizes(self) -> dict[str, int]:
        return self.inner.state_sizes()
