"""The one place the simulator talks to a routing policy: the same policy object as the router service
(framework/serving/router.py), on the simulated clock, with `maintain(now)` at the service's interval. Requests go in
as a RequestView with their token ids and come back with the worker's usage. Not passed yet: worker events (KV
events, load reports) for the policies that learn from them. A change of the policy interface is a change here only."""
from __future__ import annotations

from framework.routing import RequestUsage, RequestView, RoutingDecision


class SimRouter:
    def __init__(self, policy, workers: list[str], maintain_interval_s: float):
        self.policy, self.now = policy, 0.0
        self.interval = maintain_interval_s
        policy.clock = lambda: self.now
        for w in workers:
            policy.add_worker(w)
        self.reasons: dict[str, int] = {}
        self.matched = self.chars = 0

    def route(self, text: str, token_ids: list[int], now: float) -> tuple[str, RoutingDecision | None]:
        """The worker for a request sent at `now`, and the policy's decision (given back with `done`)."""
        self.now = now
        worker = self.policy.select(RequestView(text, token_ids))
        decision = self.policy.last_decision
        if decision is not None:
            self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
            self.matched += decision.matched_chars
            self.chars += decision.request_chars
        return worker, decision

    def done(self, worker: str, decision: RoutingDecision | None, now: float, ok: bool = True, req=None) -> None:
        """The request is over on `worker` (its usage, as the worker reports it, from `req` when it was served)."""
        self.now = now
        usage = None if req is None else RequestUsage(len(req.prompt_ids), max(req.cached_tokens, 0),
                                                      len(req.output_ids))
        self.policy.on_request_done(worker, decision, ok, usage)

    def maintain(self, now: float) -> None:
        self.now = now
        self.policy.maintain(now)

    def figures(self) -> dict:
        """The router's keys of a cluster bench's results (framework/serving/cluster_bench.py)."""
        return {"router_estimated_hit_rate": self.matched / self.chars if self.chars else float("nan"),
                "router_reasons": dict(sorted(self.reasons.items()))}
