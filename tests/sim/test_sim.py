"""mode=sim: the simulator drives the real scheduler over counting pools, the same results keys as a bench,
deterministic, decode runs exactly equal to single steps, every workload, DeepSeek shapes with nothing allocated."""
from __future__ import annotations

import json
import random

import pytest
import torch

from framework.app import run
from framework.core.errors import UserError
from framework.config import compose
from framework.engine.config import EngineConfig
from framework.engine.kv_pool import CountingKVPool, KVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler
from framework.report.metrics import summarize
from framework.core.registry import ROUTING
from framework.runs.sim import simulate

SMALL = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "workload.num_conversations=6",
         "workload.turns=3", "workload.output_len=16"]


def _drive(sched: Scheduler, arrivals: list[tuple[int, Req]], tokens) -> None:
    pending, step = list(arrivals), 0
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        batch = sched.next_batch()
        if batch is not None:
            sched.process(batch, [tokens(r) for r, s in zip(batch.reqs, batch.sample) if s], float(step))
        step += 1
        assert step < 5000


def _requests(seed: int) -> list[tuple[int, Req]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    return [((at := rng.randrange(60)),       # arriving at that step, on the step clock _drive's process() reads
             Req(shared[:rng.randrange(41)] + [rng.randrange(256) for _ in range(rng.randrange(1, 50))],
                 SamplingParams(max_new_tokens=rng.randrange(1, 40), ignore_eos=True), rid=f"r{i}",
                 arrival_time=float(at)))
            for i in range(40)]


def test_counting_pool_makes_the_real_pools_decisions():
    """The same requests through the scheduler over a real KV pool and over a counting one: identical step logs
    (retractions and radix-cache evictions included: the pool is tight), and the same free slots at the end."""
    logs = []
    for pool in (KVPool(1, 1, 150, torch.float32), CountingKVPool(150)):
        sched = Scheduler(EngineConfig(chunked_prefill_tokens=32, init_new_token_ratio=0.1), pool, eos_id=-1,
                          decode_tail=lambda i: "")
        sched.step_log = []
        _drive(sched, sorted(_requests(2), key=lambda a: a[0]), lambda r: 7)
        logs.append((sched.step_log, pool.available() + sched.cache.evictable_size(), sched.stats))
    assert logs[0] == logs[1]
    assert logs[0][2]["retractions"] > 0 and logs[0][1] == 150


def _sim(overrides: list[str]) -> tuple[dict, list]:
    return simulate(compose(SMALL + overrides))


@pytest.mark.parametrize("extra", [
    ["workload.request_rate=50", "cluster.instances=3"],                              # arrivals cut decode runs
    ["sim.cost=roofline", "engine.cuda_graph_max_context=300", "workload.request_rate=50"],   # graphs, their width
    ["sim.cost=roofline", "sim.cost.host_output_token_us=0.5", "sim.cost.stream_us_per_output_token=2",
     "workload.request_rate=50"],                                      # prices growing with the output so far
    ["parallel=dp_attn", "parallel.size=2", "moe=triton_fused", "workload.request_rate=80"],   # IDLE groups
    ["engine.kv_budget_mb=0.3", "engine.radix_cache=false", "workload.ignore_eos=false", "workload.turns=1",
     "workload.num_conversations=24", "workload.system_prompt_len=0", "workload.user_len=8", "workload.output_len=64",
     "workload.max_concurrency=0", "cluster.instances=1", "parallel=dp_attn", "parallel.size=2",
     "moe=triton_fused"],                                                                    # retractions
])
def test_decode_runs_equal_single_steps(extra):
    """fast_forward advances runs of decode steps in one event: the very records, and engine figures, of stepping
    one step at a time."""
    fast, fast_records = _sim(extra + ["sim.fast_forward=true"])
    slow, slow_records = _sim(extra + ["sim.fast_forward=false"])
    assert fast_records == slow_records
    skip = ("sim_wall_s", "sim_requests_per_wall_s", "sim_cpu_s")
    same = [json.dumps({k: v for k, v in r.items() if k not in skip}, default=str) for r in (fast, slow)]
    assert same[0] == same[1] and fast["requests_failed"] == 0
    assert fast["requests_completed"] == (24 if "workload.turns=1" in extra else 18)
    if "engine.kv_budget_mb=0.3" in extra:
        assert fast["retractions"] > 0


def test_run_py_mode_sim_reports_like_a_bench_and_is_deterministic(tmp_path):
    """`python run.py mode=sim`: results.json with a bench's keys plus what was simulated and how fast, the same
    requests.jsonl, identical for the same seed."""
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        run(compose(SMALL), str(out), {})
        outs.append(out)
    results = [json.loads((o / "results.json").read_text()) for o in outs]
    bench_keys = set(summarize([], 1.0)) | {"cache_hit_rate", "load_imbalance", "per_worker", "steps", "retractions",
                                            "kv_capacity_tokens_per_rank", "max_running_requests"}
    assert bench_keys <= set(results[0])
    assert results[0]["sim_cost_model"] == "calibrated" and results[0]["sim_wall_s"] > 0
    assert results[0]["sim_model"]["name"] == "tiny_mla_moe" and results[0]["requests_completed"] == 18
    assert results[0]["graph_replayed_steps"] == 0 and results[0]["graph_eager_off_steps"] > 0   # a CPU: no graphs
    skip = ("sim_wall_s", "sim_requests_per_wall_s", "sim_cpu_s")
    assert [{k: v for k, v in r.items() if k not in skip} for r in results][0] == \
        [{k: v for k, v in r.items() if k not in skip} for r in results][1]
    assert (outs[0] / "requests.jsonl").read_text() == (outs[1] / "requests.jsonl").read_text()
    other = _sim(["seed=1"])[0]
    assert other["ttft_p50_ms"] != results[0]["ttft_p50_ms"]


@pytest.mark.parametrize("workload", ["multi_turn", "shared_prefix", "trace", "random", "sharegpt"])
def test_every_workload_runs_in_sim(workload):
    res, records = simulate(compose(["mode=sim", "logger.mode=disabled", f"workload={workload}",
                                     "workload.num_requests=12", "cluster.instances=2"]))
    assert res["requests_completed"] == len(records) == 12 and res["requests_failed"] == 0
    assert res["output_throughput_tok_s"] > 0


@pytest.mark.parametrize("router", ROUTING.keys())
def test_every_routing_policy_runs_in_sim(router):
    res, records = _sim([f"router={router}", "cluster.instances=3"])
    assert res["requests_completed"] == len(records) == 18 and sum(res["router_reasons"].values()) == 18
    # each record says why its worker was chosen and what the router expected to be cached, as over HTTP
    assert {r.route_reason for r in records} <= set(res["router_reasons"])
    estimated = sum(r.estimated_cached for r in records) / sum(r.prompt_tokens for r in records)
    assert estimated == pytest.approx(res.get("router_estimated_hit_rate", 0.0))


def test_multi_turn_answers_are_cached_like_a_real_run():
    """A conversation's next prompt holds the simulated answer: with one instance each later turn hits the cache
    for the whole previous turn, its prompt and its answer (less the last answer token, which has no KV yet)."""
    _, records = _sim(["cluster.instances=1", "workload.system_prompt_len=0"])
    turns = {(r.session, r.turn): r for r in records}
    later = [(turns[r.session, r.turn - 1], r) for r in records if r.turn > 0]
    assert later and all(r.cached_tokens >= p.prompt_tokens + p.completion_tokens - 1 for p, r in later)


def test_deepseek_v2_on_h200_with_roofline_allocates_nothing():
    """DeepSeek-V2 with DP attention on 8 x H200: the KV pools are sized from shapes and counted, never allocated."""
    res, _ = simulate(compose(["mode=sim", "logger.mode=disabled", "model=deepseek_v2", "hardware=h200",
                               "sim.cost=roofline", "parallel=dp_attn", "parallel.size=8",
                               "moe=ep", "engine.mem_budget_mb=130000", "workload=trace",
                               "workload.num_requests=20", "cluster.instances=2"]))
    assert res["requests_completed"] == 20 and res["kv_capacity_tokens_per_rank"] > 100_000
    assert res["sim_hardware"] == "h200" and res["dp_size"] == 8
    assert res["graph_replayed_steps"] > 0 and res["graph_eager_mode_steps"] > 0   # decode replays, prefill not


def test_calibrated_refuses_what_was_not_profiled():
    with pytest.raises(ValueError, match="no profile of model=deepseek_v2.*sim.cost=roofline"):
        _sim(["model=deepseek_v2", "engine.mem_budget_mb=200000"])


def test_bad_cluster_is_one_sentence():
    with pytest.raises(UserError, match="cluster.instances must be >= 1"):
        run(compose(SMALL + ["cluster.instances=0"]), "/tmp/unused", {})


def test_other_work_on_the_host_stretches_the_steps():
    """sim.host_background: busy processes of other work share the host's cores with the ranks; none: the same run."""
    base = SMALL + ["sim.host_cores=2", "cluster.instances=2"]
    alone, _ = simulate(compose(base))
    assert simulate(compose(base + ["sim.host_background=0"]))[0]["duration_s"] == alone["duration_s"]
    shared, _ = simulate(compose(base + ["sim.host_background=3"]))
    assert shared["duration_s"] > 1.5 * alone["duration_s"]
    assert shared["cache_hit_rate"] == pytest.approx(alone["cache_hit_rate"], abs=0.05)
    for bad in ("sim.host_background=-1", "sim.host_side_procs=-1"):
        with pytest.raises(UserError, match="sim.host_cores, sim.host_background and sim.host_side_procs must be >= 0"):
            run(compose(SMALL + [bad]), "/tmp/unused", {})


def test_the_router_and_client_share_the_host_over_http_only():
    """sim.host_side_procs: the router process and the load client count as that many busy processes on the host's
    cores while requests are in flight, over HTTP; the in-process driver has neither."""
    base = SMALL + ["sim.host_cores=2", "cluster.instances=2"]
    light, _ = simulate(compose(base + ["sim.host_side_procs=0"]))
    heavy, _ = simulate(compose(base + ["sim.host_side_procs=2"]))
    assert heavy["duration_s"] > 1.3 * light["duration_s"]
    one = ["cluster.http=false", "cluster.instances=1", "sim.host_cores=1"]
    assert simulate(compose(SMALL + one + ["sim.host_side_procs=0"]))[0]["duration_s"] == \
        simulate(compose(SMALL + one + ["sim.host_side_procs=2"]))[0]["duration_s"]


def test_a_counting_pool_gets_no_input_tensors():
    """The simulator runs no forward: its batches keep the shapes the cost model prices and no token ids."""
    sched = Scheduler(EngineConfig(), CountingKVPool(1000), -1, lambda ids: "")
    sched.add(Req(list(range(1, 41)), SamplingParams(max_new_tokens=3, ignore_eos=True), rid="a"))
    batch = sched.next_batch()
    assert batch.extend_lens == [40] and batch.input_ids.numel() == 0 and batch.positions.numel() == 0


def test_a_held_request_waits_for_its_prefix_and_hits_it():
    """router.hold_s in the simulator: prompts behind one 400-token system prompt, prefilled in 64-token chunks. Sent
    at once, a group's later prompts are prefilled beside the first's remaining chunks and miss part of the prompt the
    view credits them with; held until its events say it is stored, they hit it, and the estimate is the hit rate."""
    base = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "workload=shared_prefix",
            "workload.num_groups=4", "workload.prompts_per_group=4", "workload.system_prompt_len=400",
            "workload.question_len=16", "workload.output_len=4", "engine.chunked_prefill_tokens=64",
            "cluster.instances=2", "cluster.kv_events=true", "cluster.kv_block_size=8", "router=precise_prefix",
            "router.block_size=8"]
    (free, _), (held, _) = (simulate(compose(base + [f"router.hold_s={h}"])) for h in (0, 5))
    assert held["requests_completed"] == free["requests_completed"] == 16
    assert held["cache_hit_rate"] > free["cache_hit_rate"] + 0.01
    error = {name: abs(r["router_estimated_hit_rate"] - r["cache_hit_rate"])
             for name, r in (("free", free), ("held", held))}
    assert error["held"] < 0.01 < error["free"], error


def test_the_engine_part_of_the_ttft_is_the_whole_ttft_with_no_network_or_router():
    """engine_ttft_ms_mean (arrival at the engine to the first token, summed by each scheduler) against the
    client's TTFT: equal with no network or router time, and below it by their time otherwise; the TTFT by turn
    comes with a multi-turn workload."""
    base = ["mode=sim", "workload=multi_turn", "workload.num_conversations=6", "workload.turns=2",
            "logger.mode=disabled"]
    free, _ = simulate(compose(base + ["sim.network_latency_s=0", "sim.router_overhead_s=0"]))
    assert free["engine_ttft_ms_mean"] == pytest.approx(free["ttft_mean_ms"], rel=1e-9)
    paid, _ = simulate(compose(base))
    assert paid["ttft_mean_ms"] - paid["engine_ttft_ms_mean"] == pytest.approx(
        (4 * 0.00005 + 0.0008) * 1e3, rel=1e-6)                # 2 hops each way, the router once
    assert len(paid["ttft_p50_ms_by_turn"]) == 2


def test_batch_arrivals_starts_an_idle_instance_once_every_arrival_of_that_instant_is_in():
    """Eight first turns sent at once reach two workers at the same instant: by default the first to arrive runs
    alone and the others wait for the next step; with sim.batch_arrivals the first step takes them together (its
    budget allowing), so the first TTFT on a worker is shared."""
    def first_ttfts(on):
        _, recs = simulate(compose(SMALL[:3] + ["workload=multi_turn", "workload.num_conversations=8",
                                                "workload.max_concurrency=8", "workload.turns=1", "cluster.instances=2",
                                                f"sim.batch_arrivals={on}"]))
        by = {}
        for r in recs:
            by.setdefault(r.worker, []).append(r.ttft_s)
        return [sorted(t) for t in by.values()]
    for ttfts in first_ttfts("false"):
        assert ttfts[0] < ttfts[1]                            # the first arrival alone
    for ttfts in first_ttfts("true"):
        assert ttfts[0] == pytest.approx(ttfts[1])            # the first step holds several
