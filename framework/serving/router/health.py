"""Per-worker reliability state for the router: health, circuit breaker, Retry-After, in-flight count and
draining; and the timer that gives up waits on a worker (silence, the client's deadlines).

A worker receives new requests only when it is ``routable``: its last health check passed, it is not being drained,
no Retry-After it sent is still running, and its circuit breaker lets traffic through. Health (a periodic
``GET /health``) and the breaker (consecutive request failures) are separate signals: a worker can answer /health
while its engine fails every request.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from yarl import URL

from framework.serving.http.errors import ApiError

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
    healthy: bool = False  # set by health checks; a new worker waits for its first passing check
    unreachable: bool = False  # a connection to it was refused: it may come back restarted, with an empty cache
    draining: bool = False
    not_before: float = 0.0  # time.monotonic() until which its Retry-After asks for no new requests
    in_flight: int = 0
    requests: int = 0  # requests sent to it (attempts, retries included)
    failures: int = 0  # breaker failures: connection errors, 5xx but 503/504
    last_health_error: str | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()
        self._endpoints: dict[str, URL] = {}

    def endpoint(self, path: str) -> URL:
        """``url + path`` as a parsed URL, built once per path (aiohttp would parse a string on every request)."""
        u = self._endpoints.get(path)
        if u is None:
            u = self._endpoints[path] = URL(self.url + path)
        return u

    def routable(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.not_before and self.breaker.available(now)

    def begin(self, now: float) -> None:
        self.in_flight += 1
        self.requests += 1
        self.idle.clear()
        self.breaker.on_dispatch(now)

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def describe(self) -> dict:
        now = time.monotonic()
        return {"url": self.url, "routable": self.routable(now), "healthy": self.healthy, "draining": self.draining,
                "in_flight": self.in_flight,
                "requests": self.requests, "failures": self.failures, "breaker": self.breaker.state,
                "retry_after_s": round(max(0.0, self.not_before - now), 3),
                "last_health_error": self.last_health_error}


class WorkerTimeout(TimeoutError):
    """A wait on a worker ran out. ``silence``: the worker said nothing for ``request_timeout_s`` (another worker may
    be tried once this one confirms it dropped the request); otherwise one of the client request's deadlines passed."""

    def __init__(self, message: str, silence: bool):
        super().__init__(message)
        self.silence = silence


class WaitTimer:
    """Gives up a wait on a worker at the earlier of ``silence_s`` after it began (streams only: a non-streaming
    answer is silent by design until it is whole) and the client request's deadline, with one periodic ``sweep``
    instead of a timer each.

    Why not aiohttp's timeouts: they schedule and cancel asyncio timer handles (pure-Python objects, kept in a heap
    through pure-Python comparisons) on every request and every chunk; ~3% of the router's CPU per request
    (experiments/bench_router). Here a wait costs a dict insert and delete; the price is precision: a wait is given
    up between its expiry and ``tick_s`` later.

    Each wait runs inside ``with timer(deadline, name):`` -- the response head together with a buffered body (a
    worker sends them together), or one stream chunk. The sweep cancels a task whose wait expired, and leaving the
    block turns that cancellation into ``WorkerTimeout``, as ``asyncio.timeout`` does; a cancellation from elsewhere
    (the client left) passes through unchanged. A task waits on one thing at a time, so tasks are the keys.
    """

    def __init__(self, silence_s: float, tick_s: float):
        self.silence_s, self.tick_s = silence_s, tick_s
        self._waiting: dict[asyncio.Task, tuple[float, str]] = {}  # task -> (expiry, which limit), time.monotonic
        self._expired: dict[asyncio.Task, str] = {}  # tasks the sweep cancelled -> which limit
        self._next: tuple[float, str, bool] = (float("inf"), "", True)

    def __call__(self, deadline: float, name: str, silence: bool = True) -> "WaitTimer":
        """The next ``with`` block's limits: the client request's deadline (and the setting that set it), and whether
        the worker's silence counts too."""
        self._next = (deadline, name, silence)
        return self

    def __enter__(self) -> None:
        deadline, name, silence = self._next
        self._next = (float("inf"), "", True)
        expiry = time.monotonic() + self.silence_s if silence else float("inf")
        if deadline < expiry:
            expiry, silence_name = deadline, name
        else:
            silence_name = ""
        self._waiting[asyncio.current_task()] = (expiry, silence_name)

    def __exit__(self, exc_type, exc, tb) -> None:
        task = asyncio.current_task()
        del self._waiting[task]
        name = self._expired.pop(task, None)
        # uncancel() == 0: nobody else asked to cancel this task meanwhile (Python >= 3.11)
        if name is not None and exc_type is asyncio.CancelledError and task.uncancel() == 0:
            if name:
                raise WorkerTimeout(f"the client request's deadline passed ({name})", silence=False) from None
            raise WorkerTimeout(f"the worker was silent for {self.silence_s:g}s (router.request_timeout_s)",
                                silence=True) from None

    def sweep(self, now: float) -> None:
        for task, (expiry, name) in self._waiting.items():
            if now > expiry and task not in self._expired:
                self._expired[task] = name
                task.cancel()


def normalize_worker_url(url: str | None) -> str:
    """A worker's identity: ``http(s)://host:port`` without a trailing slash; a 400 naming ``url`` otherwise."""
    if not url:
        raise ApiError(400, "url: query parameter required, e.g. ?url=http://127.0.0.1:30001", param="url")
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ApiError(400, f"url: {url!r} is not an http(s)://host:port URL", param="url")
    return str(parsed).rstrip("/")


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
