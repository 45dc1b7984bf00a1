"""Prefill/decode disaggregation in mode=sim (framework/sim/pd.py): requests conserved and every slot given back, the
transfer's time from its bytes and its links' contention, the deciders' choice, and mixed mode untouched."""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from framework.config import compose
from framework.core.registry import COST
from framework.runs.sim import build, cost_instance, simulate
from framework.core.registry import WORKLOAD
from framework.sim.pd import LinkNet, placement

BASE = ["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=32", "workload.max_concurrency=16",
        "cluster.instances=3"]
PD_ROLES = ["prefill", "decode", "decode"]


@lru_cache(maxsize=None)
def _base():
    return compose(BASE)


def _with_roles(roles, cfg=None):
    cfg = cfg or _base()
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, roles=list(roles)))


def _run(cfg):
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    sim = build(cfg, sessions)
    records, _ = sim.run()
    return sim, records, sessions


def test_pd_conserves_requests_and_gives_every_slot_back():
    sim, records, sessions = _run(_with_roles(PD_ROLES))
    assert len(records) == sum(len(s.turns) for s in sessions) and all(r.ok for r in records)
    assert len({(r.session, r.turn) for r in records}) == len(records)
    assert sim.pd.stats.transfers == len(records) and not sim.pd.pairs and not sim.pd.net.flows
    assert {r.worker for r in records} <= set(sim.pd.decode)            # the client's answer is the decode side's
    assert all(r.kv_transfer_bytes == r.prompt_tokens * sim.pd.kv_bytes[r.worker] for r in records)
    # a decode instance pre-allocates at its next step, also while it decodes (not after a run of steps)
    itl = sorted(x for r in records for x in r.itl_s)
    assert max(sim.pd.stats.slot_wait_s) < 3 * itl[-1]
    for name, inst in sim.instances.items():
        for g in inst.groups:
            assert g.disagg.pending() == 0
            # nothing held: every slot is free or in the radix cache, unlocked (the pool back to its start)
            assert g.pool.available() + g.cache.evictable_size() == g.pool.capacity, name


def test_transfer_time_grows_with_bytes_and_with_contention():
    cost = COST.build("roofline", COST.get("roofline").Config(), cost_instance(_base()))   # hardware=h100_sxm
    gpus = {"p0": 1, "p1": 1, "d0": 1, "d1": 1, "far": 1}
    nodes = {"p0": 0, "p1": 0, "d0": 0, "d1": 0, "far": 1}

    def landing(flows):
        net = LinkNet(cost, gpus, nodes)
        for key, src, dst, nbytes in flows:
            net.start(0.0, key, src, dst, nbytes)
        out = {}
        while (t := net.next_time()) is not None:
            out.update({k: when for when, k in net.landed(t)})
        return out

    mb = 2**20
    alone = landing([("a", "p0", "d0", 64 * mb)])["a"]
    assert landing([("a", "p0", "d0", 128 * mb)])["a"] > 1.9 * alone                   # twice the bytes
    assert landing([("a", "p0", "d0", 64 * mb), ("b", "p0", "d1", 64 * mb)])["a"] > 1.9 * alone   # one egress
    assert landing([("a", "p0", "d0", 64 * mb), ("b", "p1", "d0", 64 * mb)])["a"] > 1.9 * alone   # one ingress
    assert landing([("a", "p0", "d0", 64 * mb), ("b", "p1", "d1", 64 * mb)])["a"] == pytest.approx(alone)  # apart
    assert landing([("a", "p0", "far", 64 * mb)])["a"] > 5 * alone                     # the NIC, not NVLink
    assert cost.kv_transfer_time(64 * mb, True) == pytest.approx(alone)


def test_instances_fill_nodes_in_order():
    names = [f"i{k}" for k in range(5)]
    assert placement(names, dict.fromkeys(names, 4), 8) == {"i0": 0, "i1": 0, "i2": 1, "i3": 1, "i4": 2}
    assert placement(["a", "b", "c"], {"a": 2, "b": 8, "c": 2}, 8) == {"a": 0, "b": 1, "c": 2}


def test_decode_first_prefills_short_uncached_prompts_on_the_decode_instance():
    """round_robin keeps no cache estimate: every prompt token counts as uncached, so the prompt's length decides."""
    threshold = 190
    sim, records, _ = _run(compose(BASE + ["cluster.roles=[prefill,decode,decode]", "router=round_robin",
                                           "router.pd_decider=decode_first",
                                           f"router.pd_local_prefill_max_tokens={threshold}",
                                           "engine.disaggregation_local_prefill=true", "workload.input_len=256"]))
    local = [r for r in records if r.kv_transfer_bytes == 0]
    remote = [r for r in records if r.kv_transfer_bytes > 0]
    assert local and remote and len(records) == len(local) + len(remote)
    assert all(r.prompt_tokens <= threshold for r in local) and all(r.prompt_tokens > threshold for r in remote)
    assert sim.pd.stats.local_prefills == len(local)


def test_explicit_mixed_roles_change_nothing():
    plain, _ = simulate(_base())
    mixed, _ = simulate(_with_roles(["mixed"] * 3))
    keys = ("duration_s", "ttft_p50_ms", "tpot_p50_ms", "output_throughput_tok_s")
    assert [plain[k] for k in keys] == [mixed[k] for k in keys] and "pd_transfers" not in mixed


def test_a_bad_role_list_is_one_sentence():
    with pytest.raises(ValueError, match="cluster.roles"):
        build(_with_roles(["prefill"] * 3), [])


def test_a_prefill_instance_full_of_held_kv_resumes_once_it_is_sent():
    """A prefill pool so small that held KV refuses the next request (batch_is_full): sending it frees the room and
    lets the waiting ones in (framework/engine/disagg.py `sent`), so the run ends with every request answered."""
    cfg = _with_roles(PD_ROLES, compose(BASE + ["engine.kv_budget_mb=0.4", "workload.input_len=120"]))
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    sim = build(cfg, sessions)
    sim.pd.prefill_after_slots = False        # DistServe's order: prefills run at once and hold their KV
    records, _ = sim.run()
    assert sim.instances["sim://instance-0"].groups[0].pool.capacity < 3 * 120      # room for two prompts at most
    assert len(records) == sum(len(s.turns) for s in sessions) and all(r.ok for r in records)


def test_round_robin_decode_first_turns_over_every_instance_of_each_role():
    """decode_first selects the decode worker, then the prefill worker, each on its own role's position (one shared
    round-robin counter would use every other decode instance and one prefill instance of two)."""
    roles = ["prefill", "prefill", "decode", "decode", "decode", "decode"]
    cfg = compose(BASE + ["cluster.instances=6", f"cluster.roles=[{','.join(roles)}]", "router=round_robin",
                          "router.pd_decider=decode_first", "router.pd_local_prefill_max_tokens=0",
                          "engine.disaggregation_local_prefill=true"])
    sim, records, _ = _run(cfg)
    assert {r.worker for r in records} == set(sim.pd.decode)
    assert all(sim.instances[n].groups[0].stats["extend_steps"] > 0 for n in sim.pd.prefill)
