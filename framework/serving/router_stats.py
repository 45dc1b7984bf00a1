"""The router's own numbers: Prometheus series (``GET /metrics``) and the JSON the bench client reads (``/router_stats``).

Per-request updates are a few dict and counter operations; anything derived (percentiles, per-worker gauges) is
computed when scraped, off the request path.
"""
from __future__ import annotations

import time
from collections import Counter as Tally, deque
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from framework.serving.health import OPEN, WorkerState

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
        self.reset()

    def reset(self) -> None:
        self.decisions = 0
        self.decision_us: deque[float] = deque(maxlen=DECISION_WINDOW)
        self.matched_chars = self.request_chars = 0
        self.reasons: Tally[str] = Tally()
        self.retries = 0
        self.outcomes: Tally[str] = Tally()
        self.worker_requests: Tally[str] = Tally()
        self.since = time.time()

    def decision(self, worker: str, elapsed_us: float, matched_chars: int, request_chars: int, reason: str) -> None:
        self.decisions += 1
        self.decision_us.append(elapsed_us)
        self.matched_chars += matched_chars
        self.request_chars += request_chars
        self.reasons[reason] += 1
        self.worker_requests[worker] += 1

    def snapshot(self, workers: Iterable[WorkerState]) -> dict:
        us = sorted(self.decision_us)
        return {
            "decisions": self.decisions,
            "router_decision_us": {"p50": percentile(us, 50), "p99": percentile(us, 99),
                                   "mean": sum(us) / len(us) if us else 0.0, "max": us[-1] if us else 0.0,
                                   "window": len(us)},
            "estimated_hit_rate": self.matched_chars / self.request_chars if self.request_chars else 0.0,
            "matched_chars": self.matched_chars, "request_chars": self.request_chars,
            "reasons": dict(self.reasons),
            "retries": self.retries,
            "outcomes": dict(self.outcomes),
            "per_worker_requests": dict(self.worker_requests),
            "workers": [w.describe() for w in workers],
            "process_cpu_s": time.process_time(),  # the router process's CPU, for CPU-per-request figures
            "since_unix_s": self.since,
        }


class RouterMetrics:
    """Prometheus series in a per-app registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("servelab_router_requests", "Client requests by route and outcome",
                                ["route", "outcome"], registry=r)
        self.decisions = Counter("servelab_router_decisions", "Routing decisions by worker and reason",
                                 ["worker", "reason"], registry=r)
        self.retries = Counter("servelab_router_retries", "Attempts retried on another worker", registry=r)
        self.decision_latency = Histogram("servelab_router_decision_latency_seconds", "Time in policy.select",
                                          buckets=DECISION_BUCKETS_S, registry=r)
        self.in_flight = Gauge("servelab_router_worker_in_flight", "Requests in flight per worker", ["worker"],
                               registry=r)
        self.healthy = Gauge("servelab_router_worker_healthy", "1 if the last health check passed", ["worker"],
                             registry=r)
        self.breaker_open = Gauge("servelab_router_worker_breaker_open", "1 while the circuit breaker is open",
                                  ["worker"], registry=r)
        self._decision_children: dict[tuple[str, str], object] = {}

    def decision(self, worker: str, reason: str, elapsed_s: float) -> None:
        key = (worker, reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(worker, reason)
        child.inc()
        self.decision_latency.observe(elapsed_s)

    def refresh_gauges(self, workers: Iterable[WorkerState], removed: Iterable[str] = ()) -> None:
        for url in removed:
            for g in (self.in_flight, self.healthy, self.breaker_open):
                try:
                    g.remove(url)
                except KeyError:
                    pass
        for w in workers:
            self.in_flight.labels(w.url).set(w.in_flight)
            self.healthy.labels(w.url).set(int(w.healthy))
            self.breaker_open.labels(w.url).set(int(w.breaker.state == OPEN))
