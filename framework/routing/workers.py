"""What the router knows of one worker: health, circuit breaker, Retry-After, draining, and its requests in flight.

A worker receives new requests only when it is ``routable``: its last health check passed, it is not being drained,
no Retry-After it sent is still running, and its circuit breaker lets traffic through. Health (set by whoever checks
it: the HTTP router's periodic ``GET /health``; always healthy in the simulator) and the breaker (consecutive request
failures) are separate signals: a worker can answer /health while its engine fails every request.

The in-flight count is kept once, in the routing policy's ``loads`` (bumped by ``select``, released by
``on_request_done``; the router core makes both calls); ``WorkerState.in_flight`` reads it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """closed --(``threshold`` consecutive failures)--> open --(``cooldown_s``)--> half_open: one probe request goes
    through; its success closes the breaker, its failure opens it again for another cool-down."""

    def __init__(self, threshold: int, cooldown_s: float):
        if threshold < 1:
            raise ValueError(f"breaker_failure_threshold must be >= 1, got {threshold}")
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probe_in_flight = False
        self.times_opened = 0

    def available(self, now: float) -> bool:
        """Whether a new request may go to this worker (does not change state; see ``on_dispatch``)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.cooldown_s
        return not self.probe_in_flight

    def on_dispatch(self, now: float) -> None:
        if self.state == OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN:
            self.probe_in_flight = True

    def record_success(self) -> None:
        self.state, self.consecutive_failures, self.probe_in_flight = CLOSED, 0, False

    def record_failure(self, now: float) -> None:
        self.consecutive_failures += 1
        self.probe_in_flight = False
        if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive_failures >= self.threshold):
            self.state, self.opened_at = OPEN, now
            self.times_opened += 1

    def record_neutral(self) -> None:
        """The request ended without telling anything about the worker (the client left): free the probe slot."""
        self.probe_in_flight = False


@dataclass(eq=False)  # compared by identity: a URL removed and added again is another worker
class WorkerState:
    url: str
    breaker: CircuitBreaker
    loads: Mapping[str, int]  # the policy's in-flight counts, which ``in_flight`` reads (one count, kept once)
    healthy: bool = False  # set by health checks; a new worker waits for its first passing check
    unreachable: bool = False  # a connection to it was refused: it may come back restarted, with an empty cache
    draining: bool = False
    not_before: float = 0.0  # clock time until which its Retry-After asks for no new requests
    requests: int = 0  # requests sent to it (attempts, retries included)
    failures: int = 0  # breaker failures: connection errors, 5xx but 503/504
    last_health_error: str | None = None
    endpoints: dict = field(default_factory=dict)  # the driver's own per-worker cache (the HTTP router's parsed URLs)
    # P/D disaggregation (GET /server_info): mixed | prefill | decode, None until asked; a prefill's bootstrap port;
    # whether a decode worker serves a request without bootstrap fields itself (engine.disaggregation_local_prefill)
    role: str | None = None
    bootstrap_port: int | None = None
    local_prefill: bool = False
    clock: Callable[[], float] = time.monotonic  # the router's (``describe``'s default time)

    @property
    def in_flight(self) -> int:
        """Its requests in flight (held at the router or sent), as the policy counts them: 0 once it is removed."""
        return self.loads.get(self.url, 0)

    def routable(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.not_before and self.breaker.available(now)

    def describe(self, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        return {"url": self.url, "routable": self.routable(now), "healthy": self.healthy, "draining": self.draining,
                "in_flight": self.in_flight,
                "requests": self.requests, "failures": self.failures, "breaker": self.breaker.state,
                "retry_after_s": round(max(0.0, self.not_before - now), 3),
                "last_health_error": self.last_health_error}
