"""The routing-policy interface shared by the router service, the simulator and the tests.

A policy is plain synchronous Python with no I/O and no threads: the caller owns concurrency (the HTTP router calls it from
one asyncio thread), time (``clock`` and ``maintain(now)``) and retries. The base class keeps the worker list, the
router's own in-flight counts (``loads``) and the record of the last decision; a plugin only decides (``_decide``).
"""
from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

REASONS = ("balance", "cache_hit", "cache_miss", "round_robin", "random")


class RouterImpl(enum.Enum):
    """Which router process fronts the workers: servelab's own, or SGLang's (framework/serving/peer_router.py)."""
    servelab = "servelab"
    sglang = "sglang"


@dataclass
class RoutingConfig:
    """What every routing plugin's ``Config`` inherits: ``name`` (each plugin redefines it; it stays the first field)
    and the router service's settings (framework/serving/router.py: RouterServiceConfig checks them), so
    ``router.port=...`` or ``router.max_retries=...`` compose with whichever ``router=`` plugin is chosen; the policies
    themselves ignore them."""
    name: str = ""
    impl: RouterImpl = RouterImpl.servelab  # sglang: SGLang's router (sglang-router 0.3.2) with this policy
    host: str = "127.0.0.1"
    port: int = 30000                       # 0: free ports for the router and the local workers
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 2.0
    max_retries: int = 3                    # extra attempts after the first, each on another worker when there is one
    retry_backoff_base_s: float = 0.05      # attempt k waits in [d/2, d], d = min(max, base * 2**(k-1))
    retry_backoff_max_s: float = 2.0
    breaker_failure_threshold: int = 5      # consecutive failures that open a worker's circuit breaker
    breaker_cooldown_secs: float = 30.0     # open -> half-open (one probe request) after this long
    request_timeout_s: float = 600.0        # longest a worker may stay silent (no header / no chunk)
    connect_timeout_s: float = 5.0
    drain_timeout_secs: float = 600.0       # remove_worker waits this long for in-flight requests at most
    maintain_interval_secs: float = 1.0     # how often the policy's periodic work (cache eviction) runs
    client_max_size: int = 8 * 2**20        # request body limit, bytes (larger: a 413 JSON error)


class RoutingDecision(NamedTuple):
    """What the last ``select`` did. ``matched_chars`` is how much of the request's text the chosen worker had already
    been sent (by the policy's own estimate; 0 for policies that keep none), so matched/request chars summed over
    requests is the router's estimated prefix-cache hit rate."""
    worker: str
    matched_chars: int
    request_chars: int
    reason: str  # one of REASONS


class NoWorkerAvailable(RuntimeError):
    """``select`` had no worker to choose from (none added, or every added worker is marked unhealthy)."""


class RoutingPolicy(abc.ABC):
    """Base of every routing plugin. Workers are kept in the order they were added; every tie resolves in that order."""

    Config: ClassVar[type] = RoutingConfig

    def __init__(self, cfg: Any = None, seed: int = 0):
        self.cfg = cfg if cfg is not None else self.Config()
        self.seed = seed
        self.loads: dict[str, int] = {}  # worker -> requests in flight, as counted by this router
        self.last_decision: RoutingDecision | None = None
        # Seconds, used to stamp cache entries; the simulator swaps in its own clock.
        self.clock: Callable[[], float] = time.monotonic
        self._unhealthy: set[str] = set()
        self._healthy: list[str] = []  # the default candidates, in insertion order

    # -- workers -----------------------------------------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return list(self.loads)

    def add_worker(self, worker: str) -> None:
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"a worker is a non-empty string (its URL), got {worker!r}")
        if worker in self.loads:
            raise ValueError(f"worker {worker!r} is already added; workers: {self.workers}")
        self.loads[worker] = 0
        self._refresh_healthy()

    def remove_worker(self, worker: str) -> None:
        self._require_known(worker)
        del self.loads[worker]
        self._unhealthy.discard(worker)
        self._refresh_healthy()
        self._forget(worker)

    def set_healthy(self, worker: str, healthy: bool = True) -> None:
        """An unhealthy worker keeps its load count and cache estimate but is left out of the default candidates."""
        self._require_known(worker)
        (self._unhealthy.discard if healthy else self._unhealthy.add)(worker)
        self._refresh_healthy()

    # -- requests ----------------------------------------------------------------------------------------------------
    def select(self, request_text: str, workers: Sequence[str] | None = None) -> str:
        """Pick a worker among ``workers`` (default: every healthy added worker) and count the request in flight on it."""
        if not isinstance(request_text, str):
            raise TypeError(f"request_text must be a str, got {type(request_text).__name__}")
        if workers is None:
            candidates = self._healthy
            if not candidates:
                raise NoWorkerAvailable(
                    f"no healthy worker to route to (added: {self.workers}, unhealthy: {sorted(self._unhealthy)})")
        else:
            candidates = self._known_candidates(workers)
        decision = self._decide(request_text, candidates)
        self.loads[decision.worker] += 1
        self.last_decision = decision
        return decision.worker

    def on_request_done(self, worker: str, **info: Any) -> None:
        """Release one in-flight request on ``worker``. A worker removed meanwhile, or already at zero, is left alone:
        the caller makes this call once per request; the count never goes below zero."""
        n = self.loads.get(worker)
        if n:
            self.loads[worker] = n - 1

    def maintain(self, now: float | None = None) -> None:
        """Periodic work off the request path. The stateless policies have none."""

    # -- for plugins -------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _decide(self, request_text: str, candidates: list[str]) -> RoutingDecision:
        """Choose among ``candidates`` (non-empty, known, in insertion order). Loads are updated by the caller."""

    def _forget(self, worker: str) -> None:
        """Drop what the policy keeps about a removed worker. The stateless policies keep nothing."""

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _refresh_healthy(self) -> None:
        self._healthy = [w for w in self.loads if w not in self._unhealthy]

    def _require_known(self, worker: str) -> None:
        if worker not in self.loads:
            raise ValueError(f"unknown worker {worker!r}; workers: {self.workers}")

    def _known_candidates(self, workers: Sequence[str]) -> list[str]:
        if isinstance(workers, str):
            raise TypeError(f"workers is a list of worker names, got the string {workers!r}")
        wanted = set(workers)
        unknown = wanted.difference(self.loads)
        if unknown:
            raise ValueError(f"unknown workers {sorted(unknown)}; workers: {self.workers}")
        if not wanted:
            raise NoWorkerAvailable("select was given an empty list of workers")
        return [w for w in self.loads if w in wanted]
