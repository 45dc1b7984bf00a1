"""The router core: everything a router decides and counts, with no I/O. The HTTP router service
(framework/serving/router/service.py) drives it over sockets, the simulator (framework/sim/router.py) on its virtual
clock; both make the same calls in the same order for a request:

1. ``dispatch(request, pool)``: the policy picks a worker among ``pool`` (default: every routable worker); the
   decision is timed and counted per worker and reason, the request counts in flight there (the policy's ``loads``:
   the one in-flight count), and a retry counts as one;
2. ``hold(attempt)``: how long the router holds it before sending it (the policy's ``hold_s``: its prefix is still
   being prefilled on that worker). A held attempt is let go by ``worker_events`` (a batch of its worker's KV events
   after which the policy no longer holds it), by ``hold_over`` (the hold ran out) or by ``release`` (its client left);
3. ``release(attempt)``: the attempt ended. The policy hears of it (``on_request_done`` with the usage the worker
   reported, for a policy subscribed to ``USAGE``), and so do the stats: an answered attempt's estimated cache hit
   counts once -- not one whose worker broke its stream (the client retries it elsewhere, and the measured hit rate
   counts each request once), but one whose client hung up (the load client leaves at [DONE]) -- and the worker's
   circuit breaker learns the attempt's verdict.

Prefill/decode disaggregation keeps one policy per role, as sglang-router does (``--prefill-policy``,
``--decode-policy``, each defaulting to ``--policy``): ``set_role_policies`` gives the core a policy instance per role
and ``set_role`` moves a worker, once its role is known, from the router's policy into its role's, so each role's
policy sees only its role's workers, requests and events (``policy_of``).

``snapshot`` is ``GET /router_stats``' shape, with the policy's own account of its estimates (``policy_accuracy``:
estimated, confirmed and reported cached tokens) when it keeps one.
"""
from __future__ import annotations

import math
import time
from types import MappingProxyType
from typing import Any, Callable, Iterable

from framework.contracts.routing import (RESTARTED, USAGE, LoadReport, RequestUsage, RequestView, RoutingDecision,
                                         wants_first_token)
from framework.routing.stats import RouterStats
from framework.routing.workers import CLOSED, CircuitBreaker, WorkerState

OK, FAIL = "ok", "fail"  # an attempt's verdict on its worker, for the breaker (None: it tells nothing)
BROKEN_STREAM, CLIENT_DISCONNECT = "broken_stream", "client_disconnect"  # how a relayed stream ended badly
_REMOVED = MappingProxyType({})  # a removed worker's counts: none (WorkerState.in_flight reads 0)


class Attempt:
    """One try of a request on one worker, from its decision to its release."""
    __slots__ = ("worker", "decision", "policy", "verdict", "outcome", "served", "usage", "held", "ref")

    def __init__(self, worker: WorkerState, decision: RoutingDecision, policy: Any = None):
        self.worker, self.decision = worker, decision
        self.policy = policy  # the policy that decided: only it reads the decision back (the worker may change role)
        self.verdict: str | None = None  # for the breaker: OK | FAIL | None (tells nothing about the worker)
        self.outcome: str | None = None  # BROKEN_STREAM | CLIENT_DISCONNECT when a relayed stream ended badly
        self.served = False  # the worker answered 2xx: it was sent the request (the policy's cache credit stands)
        self.usage: RequestUsage | None = None  # what the worker reported, for a policy subscribed to USAGE
        self.held = False  # waiting at the router for its worker's KV events (hold)
        self.ref: Any = None  # the driver's own handle on it (the HTTP router's waiter, the simulator's flight)


def route_fields(decision: RoutingDecision) -> dict:
    """What a request's record says of its route: the policy's reason and its estimate of the cached prompt (the HTTP
    router's X-Servelab-Route header carries the same, framework/serving/http/proxy.py)."""
    return {"route_reason": decision.reason, "estimated_cached": decision.matched_chars}


class RouterCore:
    def __init__(self, policy, clock: Callable[[], float] | None = None, breaker_threshold: int = 5,
                 breaker_cooldown_s: float = 30.0):
        """``clock``: the router's time in seconds (also the policy's); None keeps the policy's (time.monotonic)."""
        self.policy = policy
        if clock is not None:
            policy.clock = clock
        self.clock = policy.clock
        self.breaker_threshold, self.breaker_cooldown_s = breaker_threshold, breaker_cooldown_s
        self.workers: dict[str, WorkerState] = {}
        self.stats = RouterStats()
        self.wants_usage = USAGE in policy.subscriptions  # read the usage from the answers only then
        self._hear_first: frozenset = frozenset({policy} if wants_first_token(policy) else ())   # (first_token)
        self.role_policies: dict[str, Any] = {}  # P/D: role -> its own policy instance (set_role_policies)
        self.on_idle: Callable[[WorkerState], None] | None = None  # a draining worker's last request ended
        self._held: dict[str, list[Attempt]] = {}  # worker url -> attempts held for it, in the order they came
        self._in_role: dict[str, Any] = {}  # worker url -> the role policy that holds it (policy_of, on every request)

    # -- workers -----------------------------------------------------------------------------------------------------
    def add_worker(self, url: str, healthy: bool = False) -> WorkerState:
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        policy = self.policy
        if url in policy.loads:  # a policy handed over with workers: start this one afresh
            policy.remove_worker(url)
        policy.add_worker(url)
        self._in_role.pop(url, None)
        state = WorkerState(url, CircuitBreaker(self.breaker_threshold, self.breaker_cooldown_s), policy.loads,
                            healthy=healthy, clock=self.clock)
        self.workers[url] = state
        return state

    def remove_worker(self, url: str) -> WorkerState:
        """Forget the worker (its requests still in flight end without reaching the policy)."""
        policy = self.policy_of(url)
        state = self.workers.pop(url)
        policy.remove_worker(url)
        self._in_role.pop(url, None)
        state.loads = _REMOVED
        return state

    # -- P/D: a policy per role -------------------------------------------------------------------------------------
    def set_role_policies(self, policies: dict[str, Any]) -> None:
        """One policy instance per role (sglang-router's P/D mode); workers whose role is known already move now."""
        for p in policies.values():
            p.clock = self.clock
        self.role_policies = dict(policies)
        self._in_role = {url: p for p in policies.values() for url in p.loads}
        self.wants_usage = any(USAGE in p.subscriptions for p in (self.policy, *policies.values()))
        self._hear_first = frozenset(p for p in (self.policy, *policies.values()) if wants_first_token(p))
        for w in self.workers.values():
            if w.role in policies:
                self.set_role(w.url, w.role)

    def set_role(self, url: str, role: str | None) -> None:
        """``url`` serves ``role``: with a policy for that role it moves there (its in-flight count with it); a role
        without one (mixed, unknown) keeps or brings it back to the router's policy."""
        w = self.workers[url]
        w.role = role
        current, target = self.policy_of(url), self.role_policies.get(role, self.policy)
        if target is current:
            return
        in_flight = current.loads.get(url, 0)
        current.remove_worker(url)
        target.add_worker(url)
        target.loads[url] = in_flight
        w.loads = target.loads
        if target is self.policy:
            self._in_role.pop(url, None)
        else:
            self._in_role[url] = target

    def policy_for(self, role: str) -> Any:
        """The policy that picks a ``role`` worker: that role's own, else the router's."""
        return self.role_policies.get(role, self.policy)

    def policy_of(self, url: str) -> Any:
        """The policy that holds worker ``url``: its role's once it moved there, else the router's."""
        return self._in_role.get(url, self.policy)

    def policies(self) -> list:
        return [self.policy, *self.role_policies.values()]

    def is_current(self, w: WorkerState) -> bool:
        """Whether ``w`` is still registered (a URL removed and added again since is another worker)."""
        return self.workers.get(w.url) is w

    def routable(self, now: float) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.routable(now)]

    def reset_worker(self, url: str, cause: str = RESTARTED) -> list[Attempt]:
        """What the policy knew of the worker's cache is void (``cause``: FLUSHED, RESTARTED, EVENTS_LOST: the
        contract's ``reset_worker``); returns the attempts held for that worker that the policy lets go now (send
        them; a caller that ignores them sends them when their hold runs out)."""
        self.policy_of(url).reset_worker(url, cause)
        return self._let_go(url)

    # -- a request ---------------------------------------------------------------------------------------------------
    def dispatch(self, request: str | RequestView, pool: Iterable[WorkerState] | None = None,
                 retry: bool = False) -> Attempt:
        """Choose the request's worker among ``pool`` (None: the policy's own candidates, every worker it was not told
        is unhealthy) and count the attempt; ``retry``: the request's earlier attempt failed."""
        t0 = time.perf_counter()
        url = self.policy.select(request, None if pool is None else [w.url for w in pool])
        decision = self.policy.last_decision
        self.stats.decision(decision, time.perf_counter() - t0)
        w = self.workers[url]
        w.requests += 1
        if w.breaker.state != CLOSED:  # a closed breaker has nothing to note
            w.breaker.on_dispatch(self.clock())
        if retry:
            self.stats.retries += 1
        return Attempt(w, decision, self.policy)

    def hold(self, att: Attempt, limit_s: float = math.inf) -> float:
        """Seconds to hold ``att`` before sending it, at most ``limit_s`` (the client's deadline); 0: send it now.
        A held attempt waits for ``worker_events``, ``hold_over`` or ``release``."""
        left = self.policy_of(att.worker.url).hold_s(att.decision)
        if left <= 0 or limit_s <= 0:
            return 0.0
        self.stats.holds += 1
        att.held = True
        self._held.setdefault(att.worker.url, []).append(att)
        return min(left, limit_s)

    def hold_over(self, att: Attempt) -> bool:
        """The hold of ``att`` ran out: True when it was still held (send it now), False when it was let go before."""
        if not att.held:
            return False
        self._unhold(att)
        return True

    def held(self) -> list[Attempt]:
        """The attempts held now, worker by worker."""
        return [a for atts in self._held.values() for a in atts]

    def tells_first_token(self, att: Attempt) -> bool:
        """Whether the policy that decided ``att`` listens to its first token (a driver marks the request with it)."""
        return att.policy in self._hear_first

    def first_token(self, att: Attempt) -> None:
        """``att``'s request got its first token (its prompt phase on its worker ended): told to the policy that decided
        it, if it listens and still holds that worker; at most once per attempt (the driver's part)."""
        policy, w = att.policy, att.worker
        if policy in self._hear_first and self.workers.get(w.url) is w and self.policy_of(w.url) is policy:
            policy.on_first_token(w.url, att.decision)

    def release(self, att: Attempt) -> None:
        """``att`` is over (answered, failed, or its client left, held or not): exactly once per attempt."""
        w, decision = att.worker, att.decision
        if att.held:  # the client left while it was held: it was never sent
            self._unhold(att)
        current = self.workers.get(w.url) is w
        if current:  # a worker moved to another role's policy since: that one holds its count, not the decision
            policy = self.policy_of(w.url)
            policy.on_request_done(w.url, decision if policy is att.policy else None, att.served, att.usage)
        if att.served and att.outcome != BROKEN_STREAM:
            self.stats.served(decision, att.usage)
        if att.verdict == OK:
            w.breaker.record_success()
        elif att.verdict == FAIL:
            w.failures += 1
            w.breaker.record_failure(self.clock())
        else:
            w.breaker.record_neutral()
        if w.draining and current and not w.in_flight and self.on_idle is not None:
            self.on_idle(w)

    # -- what the workers tell -----------------------------------------------------------------------------------------
    def worker_events(self, url: str, events: Iterable, on_error: Callable[[str, ValueError], None] | None = None,
                      ) -> list[Attempt]:
        """A batch of ``url``'s KV events, for the policy; returns the held attempts the policy lets go after it.
        ``on_error``: told of an event the policy cannot use (else its ValueError propagates)."""
        policy = self.policy_of(url)
        for event in events:
            try:
                policy.on_worker_event(url, event)
            except ValueError as e:
                if on_error is None:
                    raise
                on_error(url, e)
        return self._let_go(url)

    def _let_go(self, url: str) -> list[Attempt]:
        """The attempts held for ``url`` that the policy no longer holds, unheld."""
        held = self._held.get(url)
        if not held:
            return []
        policy = self.policy_of(url)
        go = [a for a in held if policy.hold_s(a.decision) <= 0]
        for a in go:
            self._unhold(a)
        return go

    def load_report(self, url: str, report: LoadReport) -> None:
        self.policy_of(url).on_worker_event(url, report)

    def maintain(self, now: float | None = None) -> None:
        """The policy's periodic work (cache eviction, expiry) at ``now`` (default: the clock's)."""
        now = self.clock() if now is None else now
        for p in self.policies():
            p.maintain(now)

    def snapshot(self) -> dict:
        """``GET /router_stats``: the counters since the last ``stats.reset()``, the workers, the policy's accuracy."""
        now = self.clock()
        accuracy = self.policy.accuracy   # a policy's own account of its estimates, when it keeps one
        return {**self.stats.snapshot([w.describe(now) for w in self.workers.values()]),
                "keeps_estimate": self.policy.keeps_estimate,   # whether estimated_hit_rate estimates anything
                "policy_state": self.policy.state_sizes(),      # what it remembers, counted (bounded: docs/routing.md)
                **({"role_policy_state": {r: p.state_sizes() for r, p in self.role_policies.items()}}
                   if any(p.loads for p in self.role_policies.values()) else {}),
                **({"policy_accuracy": dict(accuracy)} if accuracy else {})}

    def _unhold(self, att: Attempt) -> None:
        att.held = False
        held = self._held[att.worker.url]
        held.remove(att)
        if not held:
            del self._held[att.worker.url]
