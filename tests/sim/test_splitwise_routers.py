"""The simulator tells a routing policy of each request's first token (the contract's ``on_first_token``) exactly once,
at that token, on the worker that prefilled it, and only a policy that listens; Splitwise's routers
(plugins/routing/token_jsq.py, mixed_pool.py) end a run with every count back at zero."""
from __future__ import annotations

import pytest

from framework.config import compose
from framework.core.registry import WORKLOAD
from framework.routing.pairs import DECODE, PREFILL
from framework.runs.sim import build

BASE = ["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=24", "workload.max_concurrency=8",
        "sim.network_latency_s=0", "sim.router_overhead_s=0"]


def _spied(sim, policies):
    """Record every on_first_token call of `policies` as (worker, decision, the router's time), then pass it on."""
    calls = []
    for policy in policies:
        def spy(worker, decision, policy=policy, real=type(policy).on_first_token):
            calls.append((worker, decision, policy.clock()))
            real(policy, worker, decision)
        policy.on_first_token = spy
    return calls


def _run(overrides):
    cfg = compose(BASE + overrides)
    sim = build(cfg, WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions())
    return sim


def test_token_jsq_hears_each_first_token_once_when_it_comes_and_ends_at_zero():
    sim = _run(["router=token_jsq", "cluster.instances=3"])
    policy = sim.router.core.policy
    calls = _spied(sim, [policy])
    records, _ = sim.run()
    assert len(records) == 24 and all(r.ok for r in records)
    assert len(calls) == 24 and len({id(d) for _, d, _ in calls}) == 24    # once per request
    assert all(w == d.worker for w, d, _ in calls)
    # at the first token: the router hears it when the client would (no network here)
    assert sorted(t for _, _, t in calls) == pytest.approx(sorted(r.send_s + r.ttft_s for r in records))
    assert set(policy.pending.values()) == {0} and sum(policy.loads.values()) == 0
    assert len({r.worker for r in records}) == 3


def test_mixed_pool_hears_the_prefill_half_s_token_on_its_prompt_machine_and_reserves_the_whole_output():
    sim = _run(["router=mixed_pool", "cluster.instances=3", "cluster.roles=[prefill,prefill,decode]",
                "sim.pd_order=distserve"])
    core = sim.router.core
    pre, dec = core.role_policies[PREFILL], core.role_policies[DECODE]
    calls = _spied(sim, [pre, dec])
    asked = []
    real_decide = dec._decide

    def decide(request, candidates):
        asked.append(request.max_new_tokens)
        return real_decide(request, candidates)
    dec._decide = decide
    records, _ = sim.run()
    assert len(records) == 24 and all(r.ok and r.kv_transfer_bytes > 0 for r in records)
    assert len(calls) == 24 and len({id(d) for _, d, _ in calls}) == 24
    assert {w for w, _, _ in calls} <= set(pre.workers) and not set(pre.workers) & set(dec.workers)
    # the prompt phase ends before the KV is sent: the first token reaches the client later
    firsts = sorted(t for _, _, t in calls)
    assert all(t <= r + 1e-9 for t, r in zip(firsts, sorted(r.send_s + r.ttft_s for r in records)))
    assert sorted(asked) == sorted(t.max_new_tokens for s in sim.sessions for t in s.turns)   # the router is told
    assert set(pre.pending.values()) == {0} and set(dec.reserved.values()) == {0}
    assert {r.route_reason for r in records} <= {"least_memory", "token_memory_full"}


def test_a_policy_that_does_not_listen_is_never_called():
    sim = _run(["router=round_robin", "cluster.instances=2"])
    calls = _spied(sim, [sim.router.core.policy])
    records, _ = sim.run()
    assert len(records) == 24 and calls == []
