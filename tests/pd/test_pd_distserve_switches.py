"""DistServe's policies as switches (experiments/pd_repro round 2): its decode admission
(`engine.disaggregation_decode_reserve_tokens=0`: a request's prompt slots alone, no future tokens kept for the
decoding ones) and its pull order in mode=sim (`sim.pd_order=distserve`: the prefill at once, the KV held until the
decode side has slots)."""
from __future__ import annotations

import dataclasses

import pytest

from framework.config import compose
from framework.engine.config import EngineConfig
from framework.core.registry import WORKLOAD
from framework.runs.sim import build
from test_disagg_queues import paired, scheduler


@pytest.mark.parametrize("reserve, receiving", [(512, 1), (0, 2)])
def test_decode_admission_with_sglangs_reserve_and_with_distserves(reserve, receiving):
    s = scheduler("decode", capacity=40, disaggregation_decode_reserve_tokens=reserve)
    for k in range(2):
        s.add_paired(paired(list(range(1 + 15 * k, 16 + 15 * k)), max_new=10))
    s.next_batch()
    assert len(s.disagg.receiving) == receiving   # 15 + 10 reserved each: SGLang's takes one of 40, DistServe's two


def test_a_negative_reserve_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="disaggregation_decode_reserve_tokens must be >= 0"):
        EngineConfig(disaggregation_decode_reserve_tokens=-1).validate()


def test_sim_pd_order_distserve_prefills_before_the_slots_and_serves_every_request():
    cfg = compose(["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=8",
                   "workload.max_concurrency=8", "cluster.instances=2", "cluster.roles=[prefill,decode]",
                   "sim.pd_order=distserve"])
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    sim = build(cfg, sessions)
    assert sim.pd.prefill_after_slots is False
    records, _ = sim.run()
    assert len(records) == 8 and all(r.ok for r in records) and not sim.pd.pairs
    with pytest.raises(ValueError, match="sim.pd_order='pull' is not one of sglang, distserve"):
        build(dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, pd_order="pull")), sessions)
