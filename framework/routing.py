"""The routing-policy interface shared by the router service, the simulator and the tests.

A policy is plain synchronous Python with no I/O and no threads: the caller owns concurrency (the HTTP router calls it from
one asyncio thread), time (``clock`` and ``maintain(now)``) and retries. The base class keeps the worker list, the
router's own in-flight counts (``loads``) and the record of the last decision; a plugin only decides (``_decide``).
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

REASONS = ("balance", "cache_hit", "cache_miss", "round_robin", "random")


@dataclass
class RoutingConfig:
    """What every routing plugin's ``Config`` inherits: ``name`` (each plugin redefines it; it stays the first field).
    A policy's Config holds its own fields only; the router service's settings (``router.port``, ``router.max_retries``
    ...) are framework/serving/router_config.py's ``RouterServiceConfig``, and the schema Hydra stores for the
    ``router`` group combines both (``router_schema``), so every ``router.<key>`` composes with any ``router=``."""
    name: str = ""


class RoutingDecision(NamedTuple):
    """What the last ``select`` did. ``matched_chars`` is how much of the request's text the chosen worker had already
    been sent (by the policy's own estimate; 0 for policies that keep none), so matched/request chars summed over
    requests is the router's estimated prefix-cache hit rate. ``text`` and ``at`` (the policy clock's time of the
    decision) let a policy take back what it credited the worker with when the attempt fails (``on_request_done``)."""
    worker: str
    matched_chars: int
    request_chars: int
    reason: str  # one of REASONS
    text: str = ""
    at: float = 0.0


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

    def on_request_done(self, worker: str, decision: RoutingDecision | None = None, ok: bool = True,
                        **info: Any) -> None:
        """Release one in-flight request on ``worker``. A worker removed meanwhile, or already at zero, is left alone:
        the caller makes this call once per request; the count never goes below zero. ``ok=False`` with the request's
        ``decision``: the attempt failed, so the worker did not get the text (a policy that credited it takes it back)."""
        n = self.loads.get(worker)
        if n:
            self.loads[worker] = n - 1
        if not ok and decision is not None and worker in self.loads:
            self._take_back(decision)

    def reset_worker(self, worker: str) -> None:
        """The worker's cache is known to be empty (flushed, restarted): drop what the policy estimates it holds.
        Its load count stays."""
        self._require_known(worker)
        self._forget(worker)

    def maintain(self, now: float | None = None) -> None:
        """Periodic work off the request path. The stateless policies have none."""

    # -- for plugins -------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _decide(self, request_text: str, candidates: list[str]) -> RoutingDecision:
        """Choose among ``candidates`` (non-empty, known, in insertion order). Loads are updated by the caller."""

    def _forget(self, worker: str) -> None:
        """Drop what the policy keeps about a worker's cache (removed, flushed, restarted). Stateless: nothing."""

    def _take_back(self, decision: RoutingDecision) -> None:
        """Undo what ``select`` credited ``decision.worker`` with; the attempt failed. Stateless: nothing."""

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
