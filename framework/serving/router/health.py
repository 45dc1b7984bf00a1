"""The HTTP router's waits on workers: the timer that gives up a wait (silence, the client's deadlines), the
periodic jobs, and the workers' URLs. What the router knows of each worker (health, breaker, Retry-After, draining,
in-flight count) is the router core's (framework/routing/workers.py); the health checks that set it are control.py's.
"""
from __future__ import annotations

import asyncio
import logging
import time

from yarl import URL

from framework.routing.workers import WorkerState
from framework.serving.http.errors import ApiError

log = logging.getLogger("framework.serving.router.service")


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


def endpoint(w: WorkerState, path: str) -> URL:
    """``w.url + path`` as a parsed URL, built once per worker and path (aiohttp would parse a string every request)."""
    u = w.endpoints.get(path)
    if u is None:
        u = w.endpoints[path] = URL(w.url + path)
    return u


async def run_every(period: float, fn) -> None:
    """Await ``fn()`` every ``period`` seconds until cancelled; a failure is logged and the job goes on."""
    while True:
        await asyncio.sleep(period)
        try:
            await fn()
        except Exception:  # a periodic job must never die
            log.exception("router periodic job %s failed", getattr(fn, "__name__", fn))
