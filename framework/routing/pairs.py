"""Prefill/decode disaggregation on the router core: which workers serve a request's two halves, and whether it needs
a prefill worker at all (the per-request decider). Plain Python without I/O, as the core: the HTTP router
(framework/serving/router/pd.py) sends what is decided here.

Deciders (``router.pd_decider``):

- ``always`` (sglang-router 0.3.2's P/D mode): every request goes to a pair, chosen by the policy's ``select_pair``
  (default: one ``select`` over each role's workers).
- ``decode_first`` (llm-d's pd-profile-handler): the decode worker is chosen first; the prefill worker only when the
  prompt tokens that decode worker does not hold exceed ``router.pd_local_prefill_max_tokens``, else the decode worker
  prefills locally.
- ``conditional`` (Dynamo's disaggregated router, docs "Dynamo Disaggregation", 0.2: prefill remotely when the prompt
  length less its prefix hit exceeds ``max_local_prefill_length`` and the prefill queue is shorter than
  ``max_prefill_queue_size``): the same uncached count against the same threshold, and remote only while the least
  busy routable prefill worker has fewer than ``router.pd_max_prefill_queue`` requests in flight.

Each role is picked by its own policy instance when the core has them (``RouterCore.set_role_policies``; sglang-router's
``--prefill-policy``/``--decode-policy``, ``router.prefill_policy``/``router.decode_policy``, each defaulting to the
router's policy: ``role_policies`` builds them); without them, by the router's policy (``select_pair``).

"Tokens the decode worker holds" is the policy's own estimate (its decision's ``matched_chars`` over
``request_chars``, a ratio in the policy's unit) times the prompt's tokens (the client's token ids, else its UTF-8
bytes over ``router.pd_bytes_per_token``); a policy that keeps no estimate gives 0 held, so only the prompt's length
decides.
"""
from __future__ import annotations

import copy
import time
from typing import NamedTuple, Sequence

from framework.contracts.routing import RequestView, RoutingDecision
from framework.core.registry import ROUTING
from framework.routing.core import Attempt, RouterCore
from framework.routing.dp_aware import DPAware
from framework.routing.workers import CLOSED, WorkerState

ALWAYS, DECODE_FIRST, CONDITIONAL = "always", "decode_first", "conditional"
DECIDERS = (ALWAYS, DECODE_FIRST, CONDITIONAL)
PREFILL, DECODE = "prefill", "decode"


class PairPlan(NamedTuple):
    """One attempt of a disaggregated request: its prefill half (None: the decode worker prefills locally) and its
    decode half, each an ``Attempt`` the caller releases once; ``why``: the decider's reason."""
    prefill: Attempt | None
    decode: Attempt
    why: str


def prompt_tokens(request: str | RequestView, bytes_per_token: float) -> int:
    """The prompt's length in tokens: the client's token ids when it sent them, else estimated from its text."""
    if isinstance(request, RequestView):
        if request.token_ids is not None:
            return len(request.token_ids)
        request = request.text
    return int(len(request.encode()) / bytes_per_token)


def uncached_tokens(decision: RoutingDecision, tokens: int) -> int:
    """Prompt tokens the decided worker does not hold, by the policy's estimate (0 matched when it keeps none)."""
    if decision.request_chars <= 0:
        return tokens
    held = min(1.0, decision.matched_chars / decision.request_chars)
    return round(tokens * (1.0 - held))


def remote_prefill(decider: str, uncached: int, max_local_tokens: int, prefill_queue: int, max_queue: int) -> bool:
    """Whether a request goes to a prefill worker (True) or is prefilled on its decode worker (False)."""
    if decider == ALWAYS:
        return True
    if decider == DECODE_FIRST:
        return uncached > max_local_tokens
    if decider == CONDITIONAL:
        return uncached > max_local_tokens and prefill_queue < max_queue
    raise ValueError(f"router.pd_decider={decider!r}: one of {DECIDERS}")


def _attempt(core: RouterCore, url: str, decision: RoutingDecision, elapsed_s: float, retry: bool) -> Attempt:
    """The core's bookkeeping of one dispatched half (as ``RouterCore.dispatch`` does for a whole request)."""
    core.stats.decision(decision, elapsed_s)
    w = core.workers[url]
    w.requests += 1
    if w.breaker.state != CLOSED:
        w.breaker.on_dispatch(core.clock())
    if retry:
        core.stats.retries += 1
    return Attempt(w, decision, core.policy_of(url))


def _select_as(policy, role: str, request, urls: list[str]) -> str:
    """One select for `role` (a policy keeping a position per role, round robin, keeps the two apart as in
    select_pair; one shared counter would pair each decode worker with the same few prefill workers)."""
    policy.role = role
    try:
        return policy.select(request, urls)
    finally:
        policy.role = None


def role_policies(policy, prefill: str | None = None, decode: str | None = None, dp_aware: bool = False) -> dict:
    """A fresh policy instance per role (sglang-router keeps one per role): ``prefill``/``decode`` name a routing
    policy, None the router's own (``policy``'s kind and settings); a named one runs with its default settings.
    ``dp_aware`` (the HTTP router's ``router.dp_aware``, when ``policy`` is its DPAware wrapper): each role's policy
    is wrapped too, so a pair names a DP group on each side (sglang's PD router with ``--dp-aware``, sgl-project/sglang
    #26245); the wrappers share what the router learnt of each worker's dp_size."""
    outer = policy
    policy = getattr(policy, "inner", policy)   # router.dp_aware's wrapper (dp_aware.py): the roles get what it wraps

    def build(name):
        if name is None or name == getattr(policy.cfg, "name", None):
            built = type(policy)(copy.deepcopy(policy.cfg), policy.seed)
        elif name not in ROUTING.keys():
            raise ValueError(f"router.prefill_policy/decode_policy={name!r} is not a routing policy; the choices: "
                             f"{', '.join(sorted(ROUTING.keys()))}")
        else:
            built = ROUTING.get(name)(ROUTING.get(name).Config(), policy.seed)
        if dp_aware and isinstance(outer, DPAware):
            return outer.alongside(built)
        return built
    return {PREFILL: build(prefill), DECODE: build(decode)}


def dispatch_pair(core: RouterCore, request: str | RequestView, prefill_pool: Sequence[WorkerState],
                  decode_pool: Sequence[WorkerState], decider: str = ALWAYS, max_local_tokens: int = 0,
                  max_queue: int = 0, bytes_per_token: float = 1.0, retry: bool = False) -> PairPlan:
    """Choose a request's halves among the routable ``prefill_pool`` and ``decode_pool`` (both non-empty; decode
    workers that cannot prefill locally are always paired) and count them in flight."""
    p_policy, d_policy = core.policy_for(PREFILL), core.policy_for(DECODE)
    prefill_urls = [w.url for w in prefill_pool]
    if decider == ALWAYS:
        t0 = time.perf_counter()
        if p_policy is d_policy:               # one policy for both roles: its select_pair
            p, d = p_policy.select_pair(request, prefill_urls, [w.url for w in decode_pool])
            pd, dd = p_policy.last_pair
        else:                                  # a policy per role (sglang-router's): one select each
            p = _select_as(p_policy, PREFILL, request, prefill_urls)
            pd = p_policy.last_decision
            try:
                d = _select_as(d_policy, DECODE, request, [w.url for w in decode_pool])
            except BaseException:
                p_policy.on_request_done(p, pd, ok=False)    # no pair: the prefill half is not sent
                raise
            dd = d_policy.last_decision
        dt = (time.perf_counter() - t0) / 2
        return PairPlan(_attempt(core, p, pd, dt, retry), _attempt(core, d, dd, dt, False), "always")
    t0 = time.perf_counter()  # llm-d's and Dynamo's order: the decode worker first, its cache decides
    d = _select_as(d_policy, DECODE, request, [w.url for w in decode_pool])
    dd = d_policy.last_decision
    decode = _attempt(core, d, dd, time.perf_counter() - t0, retry)
    uncached = uncached_tokens(dd, prompt_tokens(request, bytes_per_token))
    queue = min(w.in_flight for w in prefill_pool)
    if not decode.worker.local_prefill:
        why = "paired_no_local_prefill"
    elif remote_prefill(decider, uncached, max_local_tokens, queue, max_queue):
        why = "remote_prefill"
    else:
        return PairPlan(None, decode, "local_prefill")
    t0 = time.perf_counter()
    try:
        p = _select_as(p_policy, PREFILL, request, prefill_urls)
    except BaseException:
        core.release(decode)                           # no pair: the decode half is not sent
        raise
    return PairPlan(_attempt(core, p, p_policy.last_decision, time.perf_counter() - t0, False), decode, why)
