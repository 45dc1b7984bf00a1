"""The instance step is written once (framework/engine/step.py); this is its oracle. mode=verify's DP-attention cases
run on real gloo ranks, each logging every step; the simulator replays the same arrivals (the same requests, in the
same order, on the same DP groups, at the same step rounds, with the same engine config) and must log the very same
steps: each DP group's forward mode (IDLE included), tokens, requests and graph decision, the step's graph
eligibility and the running requests its peak counts; and report the same step counters."""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from framework.config import compose
from framework.core.registry import COST
from framework.engine.request import Req
from framework.runs.sim import cost_instance
from framework.runs.verify import engine_cases, verify_instance
from framework.sim.instance import SimInstance

SETUPS = {"dp_attn": ["parallel=dp_attn"],                                       # 2 ranks, 2 DP groups
          "dp_attn_tp": ["parallel=dp_attn_tp", "parallel.size=4"]}               # 4 ranks, 2 DP groups of 2
COUNTERS = ("steps", "idle_steps", "graph_eligible_steps")


def config(setup: str):
    return compose(["logger.mode=disabled", *SETUPS[setup]])


@lru_cache(maxsize=None)
def on_ranks(setup: str) -> tuple[dict, dict]:
    """mode=verify's cases on a spawned instance: (each case's results, each case's step trace)."""
    traces: dict = {}
    results = verify_instance(config(setup), traces=traces)
    return results, traces


def replay(cfg, case: str, trace: dict, engine_cfg=None, move: str | None = None) -> SimInstance:
    """The simulator on the trace's arrivals: each request added to its DP group before the step round it reached the
    ranks in, its answer the tokens the ranks sampled (so the radix caches hold the same tokens), one step round at a
    time as the rank loop makes them. `move`: a request sent to the other DP group instead (the oracle must see it)."""
    cfg = dataclasses.replace(cfg, engine=engine_cfg or engine_cases(cfg)[case])
    # the cost model only prices (the replay steps round by round: no time decides anything); this CPU's profile,
    # whose hardware has no CUDA graphs, as the ranks here have none
    cost = COST.build("calibrated", COST.get("calibrated").Config(),
                      cost_instance(compose(["parallel=dp_attn", "moe=triton_fused"])))
    inst = SimInstance("oracle", cfg, cost, cfg.seed)
    inst.step.log = []
    arrivals = list(trace["arrivals"])
    while arrivals or inst.has_work():
        while arrivals and arrivals[0][0] <= inst.step.attempts:
            _, group, rid, prompt_ids, params = arrivals.pop(0)
            inst.add(Req(list(prompt_ids), dataclasses.replace(params), rid=rid),
                     dp_rank=1 - group if rid == move else group)
            inst.answers[rid] = list(trace["outputs"][rid])
        if inst.try_step() is not None:
            inst.finish_step(float(inst.step.attempts))
        assert inst.step.attempts < 100_000
    return inst


@pytest.mark.parametrize("setup", [pytest.param("dp_attn", marks=pytest.mark.long),  # ~11 s: CI's long set
                                   pytest.param("dp_attn_tp", marks=pytest.mark.slow)])
def test_the_simulator_logs_the_steps_the_ranks_ran(setup):
    results, traces = on_ranks(setup)
    cfg = config(setup)
    assert set(traces) == set(engine_cases(cfg))
    for case, trace in traces.items():
        assert results[case]["problems"] == [], (case, results[case]["problems"])
        sim = replay(cfg, case, trace)
        log = trace["log"]
        assert sim.step.log == log, case
        stats = sim.stats()
        assert {k: stats[k] for k in COUNTERS} == {k: results[case][k] for k in COUNTERS}, case
        assert stats["max_running_requests"] == max(e.running for e in log), case
    # what the logs hold: IDLE groups, both forward modes, steps with and without graph eligibility, a peak > 1
    every = [e for trace in traces.values() for e in trace["log"]]
    modes = {g.mode for e in every for g in e.groups}
    assert modes == {"extend", "decode", "idle"}
    assert {e.graph_eligible for e in every} == {True, False}
    assert {g.graph for e in every for g in e.groups} >= {"mode", "disagree", "off"}
    assert max(e.running for e in every) > 1


@pytest.mark.long  # it replays the dp_attn ranks' run above (~11 s): CI's long set
@pytest.mark.parametrize("change", ["a request on the other DP group", "a smaller largest graph bucket"])
def test_the_oracle_sees_a_different_decision(change):
    """The comparison is not vacuous: a replay that differs in one request's DP group, or in the graph buckets (the
    size rule), logs different steps."""
    _, traces = on_ranks("dp_attn")
    cfg, case = config("dp_attn"), "radix_cache"
    trace = traces[case]
    if change == "a request on the other DP group":
        sim = replay(cfg, case, trace, move=trace["arrivals"][-1][2])
    else:
        sim = replay(cfg, case, trace, engine_cfg=dataclasses.replace(engine_cases(cfg)[case], cuda_graph_max_bs=1))
    assert sim.step.log != trace["log"]


@pytest.mark.long  # it reads the dp_attn ranks' run above (~11 s): CI's long set
def test_a_round_of_requests_reaches_the_ranks_at_one_step():
    """mode=verify sends each round of requests together (InstanceClient.submit_together): rank 0 takes the whole
    round in at one step, as the single-process path adds it before stepping, however the host schedules the parent
    between requests (sent one by one, a loaded host let tight_kv_retract's first requests finish before the rest
    came, and nothing retracted)."""
    results, traces = on_ranks("dp_attn")
    for case, trace in traces.items():
        rounds: dict[int, int] = {}
        for at, *_ in trace["arrivals"]:
            rounds[at] = rounds.get(at, 0) + 1
        assert sorted(rounds.values()) == [6] * len(rounds), (case, rounds)   # verify_prompts: 6 per round
    assert results["tight_kv_retract"]["retractions"] > 0
