"""The one place the simulator talks to a routing policy: the same policy object as the router service
(framework/serving/router/service.py), on the simulated clock, with `maintain(now)` at the service's interval. Requests go in
as a RequestView with their token ids and come back with the worker's usage. The worker events the policy subscribed
to (framework/serving/router/events.py makes the same calls over sockets and HTTP):

- KV_EVENTS: each simulated radix cache's `observer` is a CacheEventEmitter in the workers' block size
  (`cluster.kv_block_size`), whose events reach `on_worker_event` at once, as the cache changes (the real path's
  ~1 ms of latency and its batching are not simulated). An instance with several DP groups sends every group's events
  as one worker's, as one publisher per instance would.
- LOAD: a LoadReport per instance every `router.load_poll_interval_s` of simulated time (GET /get_load's figures).
A request the policy holds (`hold_s`) waits at the router until the policy lets it go after one of its worker's
events, or its hold runs out (framework/sim/cluster.py).

A change of the policy interface is a change here only."""
from __future__ import annotations

from framework.kv_events.emitter import CacheEventEmitter
from framework.contracts.routing import KV_EVENTS, LOAD, RequestUsage, RequestView, RoutingDecision


class SimRouter:
    def __init__(self, policy, workers: list[str], maintain_interval_s: float, block_size: int = 0,
                 load_poll_interval_s: float = 0.0):
        self.policy, self.now = policy, 0.0
        self.interval = maintain_interval_s
        subs = policy.subscriptions
        self.block_size = block_size if KV_EVENTS in subs else 0
        if KV_EVENTS in subs and block_size < 1:
            raise ValueError(f"router={type(policy).__name__} follows KV events: give the workers' block size (>= 1)")
        self.load_interval = load_poll_interval_s if LOAD in subs else 0.0
        policy.clock = lambda: self.now
        for w in workers:
            policy.add_worker(w)
        self.reasons: dict[str, int] = {}
        self.matched = self.chars = 0
        self.on_events = None  # called with the worker after each of its KV events (the cluster releases holds)

    def watch(self, worker: str, caches) -> None:
        """Send the KV events of `worker`'s radix caches (one per DP group) to the policy, if it follows them."""
        if self.block_size:
            for cache in caches:
                cache.observer = CacheEventEmitter(self.block_size, lambda event: self._event(worker, event))

    def _event(self, worker: str, event) -> None:
        self.policy.on_worker_event(worker, event)
        if self.on_events is not None:
            self.on_events(worker)

    def report_loads(self, now: float, reports: dict) -> None:
        """The instances' LoadReports (worker -> report), as the service's poll of every worker gives them."""
        self.now = now
        for worker, report in reports.items():
            self.policy.on_worker_event(worker, report)

    def route(self, text: str, token_ids: list[int], now: float) -> tuple[str, RoutingDecision | None]:
        """The worker for a request sent at `now`, and the policy's decision (given back with `done`)."""
        self.now = now
        worker = self.policy.select(RequestView(text, token_ids))
        decision = self.policy.last_decision
        if decision is not None:
            self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        return worker, decision

    def hold_s(self, decision: RoutingDecision | None) -> float:
        """How long the request of `decision` waits at the router before it is sent (the policy's `hold_s`)."""
        return 0.0 if decision is None else self.policy.hold_s(decision)

    def done(self, worker: str, decision: RoutingDecision | None, now: float, ok: bool = True, req=None) -> None:
        """The request is over on `worker` (its usage, as the worker reports it, from `req` when it was served)."""
        self.now = now
        usage = None if req is None else RequestUsage(len(req.prompt_ids), max(req.cached_tokens, 0),
                                                      len(req.output_ids))
        self.policy.on_request_done(worker, decision, ok, usage)
        if ok and decision is not None:  # as the real router: the estimate covers the requests that were answered
            self.matched += decision.matched_chars
            self.chars += decision.request_chars

    def maintain(self, now: float) -> None:
        self.now = now
        self.policy.maintain(now)

    def stats(self) -> dict:
        """What a real router's /router_stats says of its decisions (the keys cluster_figures reads)."""
        accuracy = getattr(self.policy, "accuracy", None)  # a policy's own account of its estimates, when it keeps one
        return {"estimated_hit_rate": self.matched / self.chars if self.chars else float("nan"),
                "reasons": dict(sorted(self.reasons.items())),
                **({"policy_accuracy": dict(accuracy)} if accuracy else {})}
