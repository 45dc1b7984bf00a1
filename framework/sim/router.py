"""The simulator's router: the router core (framework/routing/core.py) that the HTTP router service drives over
sockets, driven here on the simulated clock, with the same routing policy object and `maintain(now)` at the service's
interval. Requests go in as a RequestView with their token ids (`send`: the decision and the hold) and come back with
the worker's usage (`done`). The worker events the policy subscribed to (framework/serving/router/events.py makes
the same calls over sockets and HTTP):

- KV_EVENTS: each simulated radix cache's `observer` is a CacheEventEmitter in the workers' block size
  (`cluster.kv_block_size`), whose events reach the core at once, each as a batch of its own (the real path's ~1 ms
  of latency and its batching are not simulated). An instance with several DP groups sends every group's events as
  one worker's, merged into the union of its groups' blocks (framework/kv_events/union.py, as the real router merges
  a worker's per-group batches: one group's eviction leaves a block another group holds), unless the router
  addresses DP groups itself (router.dp_aware: each group's events as a batch with its data_parallel_rank).
- LOAD: a LoadReport per instance every `router.load_poll_interval_s` of simulated time (GET /get_load's figures).
A request the policy holds (`hold_s`) waits at the router until an event of its worker lets it go (`on_release`), or
its hold runs out (`hold_over`, when the simulation's timer fires: framework/sim/cluster.py).

A change of the policy interface is a change of the core only."""
from __future__ import annotations

from typing import Callable

from framework.contracts.routing import KV_EVENTS, LOAD, RequestUsage, RequestView
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.events import KVEventBatch
from framework.kv_events.union import GroupUnion
from framework.routing.dp_aware import DPAware
from framework.routing.core import OK, Attempt, RouterCore


def usage_of(req) -> RequestUsage:
    """What a worker reports of a finished request (an engine `Req`): prompt, cached and output tokens."""
    return RequestUsage(len(req.prompt_ids), max(req.cached_tokens, 0), len(req.output_ids))


class SimRouter:
    def __init__(self, policy, workers: list[str], maintain_interval_s: float, block_size: int = 0,
                 load_poll_interval_s: float = 0.0):
        self.policy, self.now = policy, 0.0
        self.interval = maintain_interval_s
        subs = policy.subscriptions
        self.block_size = block_size if KV_EVENTS in subs else 0
        if KV_EVENTS in subs and block_size < 1:
            raise ValueError(f"router={type(policy).__name__} follows KV events: the workers must publish them "
                             f"(cluster.kv_events=true, with cluster.kv_block_size >= 1)")
        self.load_interval = load_poll_interval_s if LOAD in subs else 0.0
        self.core = RouterCore(policy, clock=lambda: self.now)
        for w in workers:
            self.core.add_worker(w, healthy=True)  # no health checks: a simulated worker never goes down
        self.on_release: Callable[[list[Attempt]], None] | None = None  # held attempts an event let go: send them

    def watch(self, worker: str, caches) -> None:
        """Send the KV events of `worker`'s radix caches (one per DP group) to the policy, if it follows them; a
        DP-aware one (router.dp_aware) gets each group's as a batch with its data_parallel_rank, any other the union
        of the groups' blocks."""
        if not self.block_size:
            return
        dp_aware = isinstance(self.policy, DPAware)
        union = GroupUnion() if len(caches) > 1 and not dp_aware else None
        for rank, cache in enumerate(caches):
            if dp_aware:
                sink = lambda event, r=rank: self.worker_events(worker, (KVEventBatch(self.now, (event,), r),))
            elif union is not None:
                sink = lambda event, r=rank: self.worker_events(
                    worker, union.events(KVEventBatch(self.now, (event,), r)))
            else:
                sink = lambda event: self.worker_events(worker, (event,))
            cache.observer = CacheEventEmitter(self.block_size, sink)

    def worker_events(self, worker: str, events) -> None:
        """KV events of `worker`, as they happen (the emitters' sinks)."""
        if not events:
            return
        released = self.core.worker_events(worker, events)
        if released and self.on_release is not None:
            self.on_release(released)

    def report_loads(self, now: float, reports: dict) -> None:
        """The instances' LoadReports (worker -> report), as the service's poll of every worker gives them."""
        self.now = now
        for worker, report in reports.items():
            self.core.load_report(worker, report)

    def send(self, text: str, token_ids: list[int], now: float, max_new_tokens: int | None = None,
             ) -> tuple[Attempt, float]:
        """A request reaching the router at `now`: its attempt (the worker and the decision; give it back with
        `done`) and how long the router holds it before sending it (0: at once)."""
        self.now = now
        att = self.core.dispatch(RequestView(text, token_ids, max_new_tokens))
        return att, self.core.hold(att)

    def first_token(self, att: Attempt, now: float) -> None:
        """The request of `att` got its first token on its worker, heard at the router at `now` (once per request,
        on the worker that prefilled it): RouterCore.first_token; the clock moves only for a policy that listens."""
        if self.core.tells_first_token(att):
            self.now = now
            self.core.first_token(att)

    def hold_over(self, att: Attempt, now: float) -> bool:
        """The hold of `att` ran out at `now`: True when it was still held (send it now)."""
        self.now = now
        return self.core.hold_over(att)

    def done(self, att: Attempt, now: float, ok: bool = True, usage: RequestUsage | None = None) -> None:
        """The request is over on its worker: answered (`ok`, with the `usage` the worker reports) or refused."""
        self.now = now
        att.verdict, att.served = OK, ok  # a refused request is the client's fault (a 4xx), not the worker's
        if ok and self.core.wants_usage:  # as the service: read for a policy subscribed to USAGE
            att.usage = usage
        self.core.release(att)

    def maintain(self, now: float) -> None:
        self.now = now
        self.core.maintain(now)

    def stats(self) -> dict:
        """A real router's /router_stats (the keys cluster_figures reads)."""
        return self.core.snapshot()
