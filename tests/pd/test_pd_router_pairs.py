"""Pair routing without I/O (framework/routing/pairs.py, framework/serving/router/pd.py): the default select_pair
over every registered policy, the deciders' branches (llm-d's decode-first rule, Dynamo's conditional
disaggregation), a worker's role from its /server_info, and the body both halves get."""
from __future__ import annotations

import json

import pytest

from framework.contracts.routing import RequestView
from framework.core.ports import free_ports
from framework.core.registry import ROUTING
from framework.routing.core import RouterCore
from framework.routing.pairs import (ALWAYS, CONDITIONAL, DECODE_FIRST, dispatch_pair, prompt_tokens, remote_prefill,
                                     uncached_tokens)
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.pd import paired_body, role_of

PREFILL = ["http://p0:1", "http://p1:1"]
DECODE = ["http://d0:1", "http://d1:1"]
BOOT = free_ports("127.0.0.1", 1)[0]   # a bootstrap port as a worker would advertise it (none is opened)


@pytest.mark.parametrize("key", ROUTING.keys())
def test_the_default_select_pair_takes_one_worker_of_each_role_and_counts_both(key):
    cls = ROUTING.get(key)
    policy = cls(cls.Config(), seed=1)
    for w in PREFILL + DECODE:
        policy.add_worker(w)
    for i in range(6):
        p, d = policy.select_pair(f"conversation {i % 2}: turn {'x' * i}", PREFILL, DECODE)
        assert p in PREFILL and d in DECODE
        assert [x.worker for x in policy.last_pair] == [p, d]
        assert all(x.reason in cls.Reasons for x in policy.last_pair)
    assert sum(policy.loads[w] for w in PREFILL) == 6 and sum(policy.loads[w] for w in DECODE) == 6
    with pytest.raises(ValueError, match="unknown workers"):   # no pair: the prefill half is not counted
        policy.select_pair("x", PREFILL, ["http://nowhere"])
    assert sum(policy.loads.values()) == 12


def test_round_robin_turns_on_each_side_as_sglang_routers_policy_per_role():
    """One counter for both selects of a pair would move twice per pair and always land on the same prefill worker
    of two; sglang-router keeps a policy per role, so each side turns on its own."""
    cls = ROUTING.get("round_robin")
    policy = cls(cls.Config())
    for w in PREFILL + DECODE:
        policy.add_worker(w)
    pairs = [policy.select_pair("x", PREFILL, DECODE) for _ in range(4)]
    assert pairs == [(PREFILL[i % 2], DECODE[i % 2]) for i in range(4)]
    assert [policy.select("x") for _ in range(2)] == [PREFILL[0], PREFILL[1]]  # a plain select: its own turn


def test_the_deciders_branches():
    assert remote_prefill(ALWAYS, 0, 100, 9, 1)
    assert not remote_prefill(DECODE_FIRST, 100, 100, 0, 1) and remote_prefill(DECODE_FIRST, 101, 100, 9, 1)
    assert remote_prefill(CONDITIONAL, 101, 100, 1, 2) and not remote_prefill(CONDITIONAL, 101, 100, 2, 2)
    assert not remote_prefill(CONDITIONAL, 50, 100, 0, 2)
    with pytest.raises(ValueError, match="pd_decider"):
        remote_prefill("sometimes", 1, 1, 1, 1)
    assert prompt_tokens("héllo", 1.0) == 6 and prompt_tokens(RequestView("abc", [1, 2]), 1.0) == 2
    assert prompt_tokens("x" * 40, 4.0) == 10


def _core(key: str, local_prefill: bool = True) -> RouterCore:
    cls = ROUTING.get(key)
    core = RouterCore(cls(cls.Config(), seed=0))
    for w in PREFILL + DECODE:
        state = core.add_worker(w, healthy=True)
        state.role = "prefill" if w in PREFILL else "decode"
        state.local_prefill = local_prefill
    return core


def _pools(core):
    return ([w for w in core.workers.values() if w.role == "prefill"],
            [w for w in core.workers.values() if w.role == "decode"])


def test_decode_first_prefills_locally_what_the_decode_worker_holds_and_pairs_the_rest():
    core = _core("cache_aware")
    prompt = "a long shared system prompt " * 20
    first = dispatch_pair(core, prompt, *_pools(core), DECODE_FIRST, max_local_tokens=64)
    assert first.prefill is not None and first.why == "remote_prefill"   # nothing cached anywhere: all uncached
    assert first.prefill.worker.role == "prefill" and first.decode.worker.role == "decode"
    for att in first:
        if att is not None and not isinstance(att, str):
            att.served = True
            core.release(att)
    again = dispatch_pair(core, prompt + "?", *_pools(core), DECODE_FIRST, max_local_tokens=64)
    assert again.prefill is None and again.why == "local_prefill"        # the decode worker holds all but a byte
    assert again.decode.worker is first.decode.worker
    assert uncached_tokens(again.decode.decision, len(prompt) + 1) <= 64


def test_a_decode_worker_that_cannot_prefill_locally_is_always_paired_and_conditional_watches_the_queue():
    core = _core("round_robin", local_prefill=False)
    plan = dispatch_pair(core, "short", *_pools(core), DECODE_FIRST, max_local_tokens=10**6)
    assert plan.prefill is not None and plan.why == "paired_no_local_prefill"
    core = _core("round_robin")
    long = "y" * 500
    one, decode = [core.workers[PREFILL[0]]], _pools(core)[1]
    assert dispatch_pair(core, long, one, decode, CONDITIONAL, max_local_tokens=100, max_queue=1).prefill
    full = dispatch_pair(core, long, one, decode, CONDITIONAL, max_local_tokens=100, max_queue=1)
    assert full.prefill is None and full.why == "local_prefill"   # the prefill worker has one in flight already
    assert dispatch_pair(core, long, one, decode, CONDITIONAL, max_local_tokens=100, max_queue=2).prefill
    assert dispatch_pair(core, "z", *_pools(core), ALWAYS).prefill is not None


def test_a_workers_role_and_the_paired_body():
    assert role_of({"disaggregation_mode": "null"}) == ("mixed", None, False)
    assert role_of({}) == ("mixed", None, False)
    assert role_of({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": BOOT}) == ("prefill", BOOT,
                                                                                                    False)
    assert role_of({"disaggregation_mode": "decode", "disaggregation_local_prefill": True}) == ("decode", None, True)
    with pytest.raises(ValueError, match="bootstrap_port"):
        role_of({"disaggregation_mode": "prefill"})
    with pytest.raises(ValueError, match="not one of"):
        role_of({"disaggregation_mode": "encode"})
    core = _core("round_robin")
    p = core.workers[PREFILL[0]]
    p.bootstrap_port = BOOT
    body = json.loads(paired_body({"text": "hi", "stream": True}, p, 12345))
    assert body == {"text": "hi", "stream": True, "bootstrap_host": "p0", "bootstrap_port": BOOT,
                    "bootstrap_room": 12345}


def test_bad_pd_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="router.pd_decider='sometimes': one of always, decode_first, conditional"):
        RouterServiceConfig(pd_decider="sometimes").validate()
    with pytest.raises(ValueError, match="pd_bytes_per_token"):
        RouterServiceConfig(pd_bytes_per_token=0).validate()
