"""The router's counters (the router core's ``RouterStats``, framework/routing/stats.py) as Prometheus series for
``GET /metrics``: cumulative, never reset, built at scrape time through a custom collector, so the request path
pays none of prometheus_client's per-call locking and label lookups. ``GET /router_stats`` is the core's
``snapshot`` (JSON, relative to the last ``POST /router_stats/reset``)."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from framework.routing.stats import DECISION_BUCKETS_S, RouterStats
from framework.routing.workers import OPEN, WorkerState


class RouterCollector(Collector):
    """Prometheus view of a router's counters and worker states, built at scrape time."""

    def __init__(self, stats: RouterStats, workers: Callable[[], Iterable[WorkerState]],
                 admission: Callable[[], dict] | None = None):
        self.stats, self.workers, self.admission = stats, workers, admission

    def collect(self):
        s = self.stats
        requests = CounterMetricFamily("servelab_router_requests", "Client requests by route and outcome",
                                       labels=["route", "outcome"])
        for (route, outcome), n in s.outcomes.items():
            requests.add_metric([route, outcome], n)
        decisions = CounterMetricFamily("servelab_router_decisions", "Routing decisions by worker and reason",
                                        labels=["worker", "reason"])
        for (worker, reason), n in s.decisions.items():
            decisions.add_metric([worker, reason], n)
        retries = CounterMetricFamily("servelab_router_retries", "Retries sent (attempts after the first)",
                                      value=s.retries)
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, DECISION_BUCKETS_S), "+Inf"), s.decision_buckets):
            cumulative += n
            buckets.append((bound, cumulative))
        latency = HistogramMetricFamily("servelab_router_decision_latency_seconds", "Time in policy.select",
                                        buckets=buckets, sum_value=s.decision_sum_s)
        gauges = {name: GaugeMetricFamily(f"servelab_router_worker_{name}", doc, labels=["worker"]) for name, doc in (
            ("in_flight", "Requests in flight per worker"), ("healthy", "1 if the last health check passed"),
            ("breaker_open", "1 while the circuit breaker is open"), ("draining", "1 while being removed"))}
        for w in self.workers():
            gauges["in_flight"].add_metric([w.url], w.in_flight)
            gauges["healthy"].add_metric([w.url], int(w.healthy))
            gauges["breaker_open"].add_metric([w.url], int(w.breaker.state == OPEN))
            gauges["draining"].add_metric([w.url], int(w.draining))
        yield from (requests, decisions, retries, latency, *gauges.values())
        if self.admission is not None:  # admission control (admission.py): refusals and the queue
            a = self.admission()
            refused = CounterMetricFamily("servelab_router_not_admitted", "Requests refused admission",
                                          labels=["reason"])
            refused.add_metric(["queue_full"], a["rejected_queue_full"])
            refused.add_metric(["queue_timeout"], a["queue_timeouts"])
            yield refused
            yield GaugeMetricFamily("servelab_router_admission_queue", "Requests waiting for admission",
                                    value=a["queued_now"])


def router_registry(stats: RouterStats, workers: Callable[[], Iterable[WorkerState]],
                    admission: Callable[[], dict] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RouterCollector(stats, workers, admission))
    return registry
