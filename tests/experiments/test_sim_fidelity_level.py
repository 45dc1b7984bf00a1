"""experiments/sim_fidelity --host-scale level: a cell's level read from a run of it at another draw (read_level),
checked on the real simulator: the level read from a block reproduces that block's own step CPU (one rank, per
kind) or duration (two ranks); and workload.seed, the other draw, leaves the weights' seed alone."""
from __future__ import annotations

import pytest

from framework.config import compose
from framework.core.registry import WORKLOAD
from framework.runs.sim import simulate
from script_loader import load_script

SIM = ["mode=sim", "sim.cost=calibrated", "sim.host_cores=2", "sim.host_sharing=fair"]
ONE_RANK = ["workload=multi_turn", "workload.num_conversations=6", "workload.turns=2", "workload.user_len=48",
            "workload.output_len=6", "workload.max_concurrency=3", "cluster.instances=2", "logger.mode=disabled"]
TWO_RANKS = ["workload=multi_turn", "workload.num_conversations=6", "workload.turns=1", "workload.user_len=8",
             "workload.output_len=12", "workload.max_concurrency=0", "parallel=tp", "parallel.size=2",
             "moe=triton_fused", "engine.radix_cache=false", "logger.mode=disabled", "cluster.http=false"]


def test_a_one_rank_level_is_the_engines_step_cpu_over_the_price_per_kind_and_reproduces_it():
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.3, None)
    plain, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load))
    real = {"extend_cpu_s": 0.8 * plain["extend_cpu_s"], "decode_cpu_s": 1.3 * plain["decode_cpu_s"],
            "duration_s": plain["duration_s"]}
    level = f.read_level("router_ablation", ONE_RANK, SIM, load, real)
    assert level == {"by": "step_cpu", "extend": pytest.approx(0.8), "decode": pytest.approx(1.3)}
    again, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load, level=level))
    for key in ("extend_cpu_s", "decode_cpu_s"):          # the batches may move a little with the new speed
        assert again[key] == pytest.approx(real[key], rel=0.05)


def test_a_two_rank_level_is_the_scale_at_which_the_block_lasts_as_long_as_it_did():
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.2, None)
    slow, _ = simulate(f.sim_config("dp_attn_vs_tp", TWO_RANKS, SIM, load, (1.6, None, None)))
    level = f.read_level("dp_attn_vs_tp", TWO_RANKS, SIM, load, {"duration_s": slow["duration_s"]})
    assert level["by"] == "duration" and level["extend"] == level["decode"] == pytest.approx(1.6, rel=0.05)
    floor = f.read_level("dp_attn_vs_tp", TWO_RANKS, SIM, load, {"duration_s": 1e-3})    # shorter than its waits
    assert floor["decode"] == f.MIN_LEVEL


def test_workload_seed_draws_other_prompts_and_keeps_the_runs_seed_elsewhere():
    def prompts(overrides):
        cfg = compose(["workload=multi_turn", "workload.num_conversations=3"] + overrides)
        return cfg, [t.text for s in WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
                     for t in s.turns]
    base, drawn = prompts([])
    cfg, other = prompts(["workload.seed=1000"])
    assert other != drawn and cfg.seed == base.seed == 0             # another draw; the weights' seed unchanged
    assert prompts(["workload.seed=1000", "seed=7"])[1] == other      # the draw is workload.seed's alone
    assert prompts(["seed=1000"])[1] == other                         # unset: the run's seed draws, as before
