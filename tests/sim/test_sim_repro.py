"""experiments/sim_repro and its experiment files (issue 9, items 5b, 5c, 7) at tiny size: the configs compose to
what they reproduce, each simulates with every request served and hit rates within their brute-force ceilings, the
script writes its table and plots, and a threshold multirun of the trace experiment draws its heat map."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import compose
from framework.core.registry import WORKLOAD
from framework.runs.sim import simulate
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
hit_rate_ceiling = load_script("experiments/routing_study/ceiling.py").hit_rate_ceiling

TINY_BLOG = ["experiment=sglang_router_blog", "cluster.instances=2", "workload.num_groups=4",
             "workload.prompts_per_group=4", "workload.system_prompt_len=256", "workload.question_len=16",
             "workload.output_len=8", "engine.chunked_prefill_tokens=256"]
TINY_TRACE = ["experiment=mooncake_trace", "cluster.instances=2", "workload.num_requests=40", "workload.time_scale=20",
              "workload.block_tokens=32", "workload.max_output_len=16"]


def _sessions(cfg):
    return WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()


def test_experiments_compose_to_what_they_reproduce():
    blog = compose(["experiment=sglang_router_blog"])
    assert (blog.mode.value, blog.sim.cost.name, blog.hardware.name, blog.router.name) == \
        ("sim", "roofline", "a100_80g", "cache_aware")
    assert blog.model.first_k_dense_replace == blog.model.num_layers         # the Llama stand-in has no MoE layer
    assert blog.workload.request_rate == 0 and blog.workload.max_concurrency == 0     # all at once
    trace = compose(["experiment=mooncake_trace"])
    assert (trace.mode.value, trace.parallel.name, trace.parallel.size, trace.model.name) == ("sim", "tp", 8,
                                                                                             "deepseek_v2")
    assert trace.workload.max_output_len == 0 and trace.workload.block_tokens == 512


def test_tiny_shared_prefix_round_robin_stays_within_its_ceiling_and_cache_aware_beats_it():
    cfg = compose(TINY_BLOG)
    sessions = _sessions(cfg)
    n = cfg.cluster.instances
    rr_ceiling = hit_rate_ceiling(sessions, lambda i: i % n)
    ceiling = hit_rate_ceiling(sessions)
    assert rr_ceiling < ceiling
    rr = simulate(compose(TINY_BLOG + ["router=round_robin"]))[0]
    ca = simulate(compose(TINY_BLOG))[0]
    assert rr["requests_completed"] == ca["requests_completed"] == len(sessions)
    assert 0 < rr["cache_hit_rate"] <= rr_ceiling + 1e-9
    assert rr["cache_hit_rate"] < ca["cache_hit_rate"] <= ceiling + 1e-9
    assert ca["total_throughput_tok_s"] > rr["total_throughput_tok_s"]


@pytest.mark.long
def test_script_and_threshold_multirun(tmp_path):
    r = subprocess.run([sys.executable, "experiments/sim_repro/run.py", "--quick", "--out", str(tmp_path / "repro")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "repro" / "results.json").read_text())
    for row in out["mooncake"]["rows"]:
        assert row["requests_failed"] == 0 and row["cache_hit_rate"] <= out["mooncake"]["ceiling_hit_rate"] + 1e-9
    assert {r["router"] for r in out["router_blog"]["rows"]} == {"round_robin", "cache_aware"}
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in out["plots"])
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "run.py", "-m", *TINY_TRACE, "router.cache_threshold=0.3,0.5",
                        "router.balance_abs_threshold=4,32", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "framework.report", str(sweep)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "4 runs" in r.stdout, r.stdout + r.stderr
    assert (sweep / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
