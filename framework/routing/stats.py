"""The router's own numbers: one set of plain counters, bumped on the request path and read at scrape time.

``snapshot`` is ``GET /router_stats``' shape (the simulator reports the same), relative to the last ``reset``; the
HTTP router also renders the cumulative counters as Prometheus series (framework/serving/router/stats.py). The request
path only bumps ints and dict entries; anything derived (percentiles, rates) happens in ``snapshot``.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter as Tally, deque

from framework.contracts.routing import RequestUsage, RoutingDecision

DECISION_WINDOW = 100_000  # decisions kept for the percentiles in /router_stats
DECISION_BUCKETS_S = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 1e-2)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


class RouterStats:
    def __init__(self) -> None:
        self.decisions: Tally[tuple[str, str]] = Tally()  # (worker, reason) -> count
        self.outcomes: Tally[tuple[str, str]] = Tally()  # (route, outcome) -> count: how client requests ended
        self.retries = 0
        self.holds = 0  # requests the policy held before sending them (hold_s)
        self.matched_chars = self.request_chars = 0
        self.reported = [0, 0, 0]  # requests, prompt and cached tokens whose usage the router read (USAGE)
        self.decision_buckets = [0] * (len(DECISION_BUCKETS_S) + 1)  # last one: above the largest bound
        self.decision_sum_s = 0.0
        self.decision_us: deque[float] = deque(maxlen=DECISION_WINDOW)
        self.reset()

    def reset(self) -> None:
        """Start a new snapshot window (the Prometheus series stay cumulative)."""
        self._base = (Tally(self.decisions), Tally(self.outcomes), self.retries, self.matched_chars,
                      self.request_chars, time.time(), list(self.reported), self.holds)
        self.decision_us.clear()

    def decision(self, d: RoutingDecision, elapsed_s: float) -> None:
        self.decisions[d.worker, d.reason] += 1
        self.decision_us.append(elapsed_s * 1e6)
        self.decision_buckets[bisect_left(DECISION_BUCKETS_S, elapsed_s)] += 1
        self.decision_sum_s += elapsed_s

    def served(self, d: RoutingDecision, usage: RequestUsage | None = None) -> None:
        """An attempt the worker answered: its estimated cache hit counts, and what the worker said it hit, when the
        router read it (see ``RouterCore.release`` for which attempts count)."""
        self.matched_chars += d.matched_chars
        self.request_chars += d.request_chars
        if usage is not None:
            r = self.reported
            r[0], r[1], r[2] = r[0] + 1, r[1] + usage.prompt_tokens, r[2] + usage.cached_tokens

    def snapshot(self, workers: list[dict]) -> dict:
        """The counters since the last reset; ``workers``: each worker's description."""
        decisions0, outcomes0, retries0, matched0, chars0, since, reported0, holds0 = self._base
        n_reported, prompt, cached = (a - b for a, b in zip(self.reported, reported0))
        decisions, outcomes = self.decisions - decisions0, self.outcomes - outcomes0
        matched, chars = self.matched_chars - matched0, self.request_chars - chars0
        per_worker, reasons, by_outcome = Tally(), Tally(), Tally()
        for (worker, reason), n in decisions.items():
            per_worker[worker] += n
            reasons[reason] += n
        for (_, outcome), n in outcomes.items():
            by_outcome[outcome] += n
        us = sorted(self.decision_us)
        return {
            "decisions": sum(decisions.values()),
            "router_decision_us": {"p50": percentile(us, 50), "p99": percentile(us, 99),
                                   "mean": sum(us) / len(us) if us else 0.0, "max": us[-1] if us else 0.0,
                                   "window": len(us)},
            "estimated_hit_rate": matched / chars if chars else 0.0,
            "matched_chars": matched, "request_chars": chars,
            # the workers' own hit rate over the requests whose usage the router read (a policy subscribed to USAGE)
            "reported_hit_rate": cached / prompt if prompt else None, "reported_requests": n_reported,
            "reasons": dict(sorted(reasons.items())),
            "retries": self.retries - retries0,
            "holds": self.holds - holds0,
            "outcomes": dict(by_outcome),
            "per_worker_requests": dict(per_worker),
            "workers": workers,
            "process_cpu_s": time.process_time(),  # the router process's CPU, for CPU-per-request figures
            "since_unix_s": since,
        }
