"""The routing-policy interface shared by the router service, the simulator and the tests.

A policy is plain synchronous Python with no I/O and no threads: the caller owns concurrency (the HTTP router calls it from
one asyncio thread), time (``clock`` and ``maintain(now)``), retries and the subscriptions to workers' events. The
base class keeps the worker list, the router's own in-flight counts (``loads``) and the record of the last decision;
a plugin only decides (``_decide``) and, when it keeps a view of the workers, listens:

- ``select(request, candidates)``: ``request`` is the request's text (a ``str``) or a ``RequestView`` (the text and,
  when the caller knows them, its token ids);
- ``on_first_token(worker, decision)``: the request's first token came from ``worker`` (its prompt phase there is
  over: the simulator calls it when the token is produced, the HTTP router when the first chunk of a relayed answer
  arrives). Callers make the call only for a policy that overrides it (``wants_first_token``), at most once per
  request and only on the worker that prefilled it; a policy must also settle without it (the real P/D path and the
  ``router.dp_aware`` wrapper do not make it);
- ``on_request_done(worker, decision, ok, usage)``: the attempt's outcome and, for a policy that subscribed to
  ``USAGE``, the usage the worker reported (prompt, cached and output tokens);
- ``on_worker_event(worker, event)``: events from a worker the policy subscribed to (``subscriptions``): KV cache
  events (framework/kv_events: BlockStored, BlockRemoved, AllBlocksCleared) and load reports (``LoadReport``). The
  router service owns the sockets and the polling; the simulator calls the same method with its own events;
- ``reset_worker(worker, cause)``: what the policy knew of that worker's cache is void: ``FLUSHED`` (its cache was
  emptied; an ``AllBlocksCleared`` event says the same), ``RESTARTED`` (a new process: its cache and its capacity may
  differ), ``EVENTS_LOST`` (the view missed events it cannot replay).

Worker lifecycle reaches a plugin through three hooks the base calls, so a policy never has to guess from other
signals: ``_worker_added(worker)``, ``_worker_removed(worker)`` and ``_worker_reset(worker, cause)`` (the last two
default to ``_forget``: drop what it keeps about that worker's cache). Every piece of state a policy keeps is tied to
one of them, or has a lifetime of its own (``maintain``); ``state_sizes`` counts it (the router's ``/router_stats``
``policy_state``, and the soak study, experiments/soak, watch that it stays bounded).

Decision reasons are the policy's own (``Reasons``), counted by the router per reason.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

from framework.kv_events.events import AllBlocksCleared

KV_EVENTS = "kv_events"  # subscription: the workers' KV cache events
LOAD = "load"            # subscription: periodic load reports (LoadReport)
USAGE = "usage"          # subscription: each request's usage in on_request_done (the router reads it from answers)
SUBSCRIPTIONS = (KV_EVENTS, LOAD, USAGE)
# why a worker's cache is void (``reset_worker``)
FLUSHED = "flushed"          # emptied (POST /flush_cache, or its AllBlocksCleared event): the same worker, cold
RESTARTED = "restarted"      # a new process behind the URL: cold, and its cache may have another size
EVENTS_LOST = "events_lost"  # the same worker and cache, but the view missed events it cannot replay
RESET_CAUSES = (FLUSHED, RESTARTED, EVENTS_LOST)
SGLANG_ROUTER_VERSION = "0.3.2"  # the sglang-router release the policies' ``sglang_args`` were checked against


@dataclass
class RoutingConfig:
    """What every routing plugin's ``Config`` inherits: ``name`` (each plugin redefines it; it stays the first field).
    A policy's Config holds its own fields only; the router service's settings (``router.port``, ``router.max_retries``
    ...) are framework/serving/router/config.py's ``RouterServiceConfig``, and the schema Hydra stores for the
    ``router`` group combines both (``router_schema``), so every ``router.<key>`` composes with any ``router=``."""
    name: str = ""


class RequestView:
    """What a policy sees of one request: its ``text`` (the routing key: the prompt, or the chat template's rendering
    of the messages) and, when the caller knows them, its ``token_ids`` (sent by the client, or tokenized by a
    simulator) and ``max_new_tokens`` (the output it may generate: the simulator's, else None). A policy that needs
    tokens and has none here tokenizes the text itself."""
    __slots__ = ("text", "token_ids", "max_new_tokens")

    def __init__(self, text: str, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None):
        self.text = text
        self.token_ids = token_ids
        self.max_new_tokens = max_new_tokens

    def __repr__(self) -> str:
        ids = "" if self.token_ids is None else f", {len(self.token_ids)} token ids"
        return f"RequestView({self.text[:40]!r}{'...' if len(self.text) > 40 else ''}{ids})"


class RequestUsage(NamedTuple):
    """What the worker said it did for a request (``usage`` / ``meta_info``)."""
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class LoadReport(NamedTuple):
    """A worker's own account of its load (SGLang's ``GET /get_load``, summed over its DP ranks), polled by the router."""
    running: int     # requests prefilling or decoding
    queued: int      # requests waiting for admission
    num_tokens: int  # KV tokens its requests hold (SGLang's num_tokens: not counting what only the cache holds)


class RoutingDecision(NamedTuple):
    """What the last ``select`` did. ``matched_chars`` is how much of the request the chosen worker holds already by the
    policy's own estimate (0 for policies that keep none), in the policy's unit (characters of the text for text
    policies, tokens for token policies; ``request_chars`` is the request's length in the same unit), so matched over
    request summed over requests is the router's estimated prefix-cache hit rate. ``text``, ``at`` (the policy clock's
    time of the decision) and ``memo`` (the policy's own record) let a policy take back what it credited the worker
    with when the attempt fails, or settle it when it ends (``on_request_done``)."""
    worker: str
    matched_chars: int
    request_chars: int
    reason: str  # one of the policy's Reasons
    text: str = ""
    at: float = 0.0
    memo: Any = None


class NoWorkerAvailable(RuntimeError):
    """``select`` had no worker to choose from (none added, or every added worker is marked unhealthy)."""


class NotExpressible(ValueError):
    """SGLang's router cannot run this policy as configured (``RoutingPolicy.sglang_args``): the message says why and
    what to do instead."""


class RoutingPolicy(abc.ABC):
    """Base of every routing plugin. Workers are kept in the order they were added; every tie resolves in that order."""

    Config: ClassVar[type] = RoutingConfig
    Reasons: ClassVar[tuple[str, ...]] = ()            # every ``RoutingDecision.reason`` this policy gives
    subscriptions: ClassVar[frozenset[str]] = frozenset()  # worker events it wants (KV_EVENTS, LOAD)
    keeps_estimate: ClassVar[bool] = False  # its decisions' matched_chars estimate the cached prefix (else always 0)
    sglang_ignores: ClassVar[tuple[str, ...]] = ()  # Config fields SGLang's router has no flag for (sglang_args)
    accuracy: dict[str, int] | None = None  # a policy's own account of its estimates beside what the workers reported
    last_pair: tuple[RoutingDecision, RoutingDecision] | None = None  # select_pair's (prefill, decode) decisions
    # The role select() picks for: None, or "prefill"/"decode" inside select_pair. sglang-router keeps one policy per
    # role; a policy whose state is a position over its candidates (round robin) keeps one per role by this key.
    role: str | None = None

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
        self._worker_added(worker)

    def remove_worker(self, worker: str) -> None:
        self._require_known(worker)
        del self.loads[worker]
        self._unhealthy.discard(worker)
        self._refresh_healthy()
        self._worker_removed(worker)

    def set_healthy(self, worker: str, healthy: bool = True) -> None:
        """An unhealthy worker keeps its load count and cache estimate but is left out of the default candidates."""
        self._require_known(worker)
        (self._unhealthy.discard if healthy else self._unhealthy.add)(worker)
        self._refresh_healthy()

    # -- requests ----------------------------------------------------------------------------------------------------
    def select(self, request: str | RequestView, workers: Sequence[str] | None = None) -> str:
        """Pick a worker among ``workers`` (default: every healthy added worker) and count the request in flight on it.
        ``request``: the text, or a ``RequestView``."""
        if type(request) is str:
            request = RequestView(request)
        elif not isinstance(request, RequestView) or not isinstance(request.text, str):
            raise TypeError(f"request must be a str or a RequestView with a str text, got {type(request).__name__}")
        if workers is None:
            candidates = self._healthy
            if not candidates:
                raise NoWorkerAvailable(
                    f"no healthy worker to route to (added: {self.workers}, unhealthy: {sorted(self._unhealthy)})")
        else:
            candidates = self._known_candidates(workers)
        decision = self._decide(request, candidates)
        self.loads[decision.worker] += 1
        self.last_decision = decision
        return decision.worker

    def select_pair(self, request: str | RequestView, prefill_workers: Sequence[str],
                    decode_workers: Sequence[str]) -> tuple[str, str]:
        """Prefill/decode disaggregation: a (prefill, decode) pair for ``request``, each counted in flight; after it,
        ``last_pair`` holds the two decisions. Default: one ``select`` over each role's workers (sglang-router's P/D
        mode), so every policy routes pairs unchanged; a policy that weighs the pair together overrides it."""
        try:
            self.role = "prefill"
            prefill = self.select(request, prefill_workers)
            first = self.last_decision
            try:
                self.role = "decode"
                decode = self.select(request, decode_workers)
            except BaseException:
                self.on_request_done(prefill, first, ok=False)  # no pair: the prefill half is not sent
                raise
        finally:
            self.role = None
        self.last_pair = (first, self.last_decision)
        return prefill, decode

    def on_request_done(self, worker: str, decision: RoutingDecision | None = None, ok: bool = True,
                        usage: RequestUsage | None = None) -> None:
        """Release one in-flight request on ``worker``. A worker removed meanwhile, or already at zero, is left alone:
        the caller makes this call once per request; the count never goes below zero. ``ok=False`` with the request's
        ``decision``: the attempt failed, so the worker did not get the request (a policy that credited it takes it
        back). ``usage``: the worker's own counts, when it reported them."""
        n = self.loads.get(worker)
        if n:
            self.loads[worker] = n - 1
        if decision is not None and worker in self.loads:
            if not ok:
                self._take_back(decision)
            self._settle(decision, ok, usage)

    def on_first_token(self, worker: str, decision: RoutingDecision) -> None:
        """The request of ``decision`` got its first token on ``worker`` (its prompt phase there ended). Default:
        nothing; callers skip the call unless a policy overrides it (``wants_first_token``)."""

    def on_worker_event(self, worker: str, event: Any) -> None:
        """An event from ``worker`` (a KV event or a ``LoadReport``), for the policies that subscribed to its kind.
        Events of a worker not added (removed meanwhile) are dropped. An ``AllBlocksCleared`` is a flush: after the
        policy's ``_observe``, ``_worker_reset(worker, FLUSHED)`` (for a policy subscribed to ``KV_EVENTS``)."""
        if worker in self.loads:
            self._observe(worker, event)
            if type(event) is AllBlocksCleared and KV_EVENTS in self.subscriptions:
                self._worker_reset(worker, FLUSHED)

    def reset_worker(self, worker: str, cause: str = RESTARTED) -> None:
        """The worker's cache is known to be empty, or what the policy learnt of it is void (``cause``: one of
        ``RESET_CAUSES``; the default assumes the least, a new process): drop what the policy estimates it holds and
        what depended on it. Its load count stays (its requests in flight end as they end)."""
        self._require_known(worker)
        if cause not in RESET_CAUSES:
            raise ValueError(f"reset cause {cause!r} is not one of {RESET_CAUSES}")
        self._worker_reset(worker, cause)

    def maintain(self, now: float | None = None) -> None:
        """Periodic work off the request path (expiry of state with a lifetime). The stateless policies have none."""

    def state_sizes(self) -> dict[str, int]:
        """What the policy remembers, counted (entries per structure), to watch that it stays bounded. Default:
        nothing but the worker list."""
        return {}

    def hold_s(self, decision: RoutingDecision) -> float:
        """Seconds the router should hold the request of ``decision`` before sending it to its worker (0: send now).
        Asked at the decision and again after each batch of that worker's events, until it answers 0. Default: 0."""
        return 0.0

    # -- what the policy declares to the router and the cluster ------------------------------------------------------
    @classmethod
    def sglang_args(cls, cfg: Any) -> list[str]:
        """sglang-router's flags (``--policy`` first, then its thresholds) that run this policy with ``cfg`` under
        ``router.impl=sglang`` (framework/cluster/peer_router.py). Raises ``NotExpressible`` with the reason when
        SGLang's router cannot; the base: it has no such policy."""
        raise NotExpressible(f"sglang-router {SGLANG_ROUTER_VERSION} has no policy like router={cfg.name}")

    @classmethod
    def ignored_keys(cls, cfg: Any) -> dict[str, str]:
        """The ``router.*`` fields this policy ignores with ``cfg`` (a switch that turns them on is off), each with why
        and what to do instead: a run that sets one is refused at start (framework/config.py). The base: none."""
        return {}

    @classmethod
    def kv_block_size(cls, cfg: Any) -> int | None:
        """Tokens per block of the KV events this policy reads (the workers must publish in that size); None: it reads
        none, or takes the cluster's (cluster.kv_block_size)."""
        return None

    # -- for plugins -------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        """Choose among ``candidates`` (non-empty, known, in insertion order). Loads are updated by the caller."""

    def _worker_added(self, worker: str) -> None:
        """``worker`` joined (or joined again: a re-added URL is a new worker, nothing is carried over). Default:
        nothing."""

    def _worker_removed(self, worker: str) -> None:
        """``worker`` left: drop everything kept about it (its requests in flight end without reaching the policy).
        Default: ``_forget``."""
        self._forget(worker)

    def _worker_reset(self, worker: str, cause: str) -> None:
        """``worker``'s cache is void for ``cause`` (see ``reset_worker``). Default: ``_forget``."""
        self._forget(worker)

    def _forget(self, worker: str) -> None:
        """Drop what the policy keeps about a worker's cache (removed, flushed, restarted). Stateless: nothing."""

    def _take_back(self, decision: RoutingDecision) -> None:
        """Undo what ``select`` credited ``decision.worker`` with; the attempt failed. Stateless: nothing."""

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        """The request of ``decision`` ended (after ``_take_back`` when it failed). Default: nothing to settle."""

    def _observe(self, worker: str, event: Any) -> None:
        """A worker event (see ``on_worker_event``). Default: ignored."""

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


def wants_first_token(policy: Any) -> bool:
    """Whether ``policy`` listens to ``on_first_token`` (it overrides it): callers on a hot path make the call only
    then, so the default costs nothing."""
    return getattr(type(policy), "on_first_token", RoutingPolicy.on_first_token) is not RoutingPolicy.on_first_token
