"""Hooks instead of leaks: framework/ names no plugin; what a plugin describes passes through whole; a cost model
describes itself; choice fields are Enums that refuse a bogus value at start, naming the allowed ones, and are
written to results.json as the value the user typed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.config import check_overrides, compose
from framework.core.registry import COST, MOE, PARALLELISM, ROUTING, WORKLOAD
from framework.runs.sim import simulate

ROOT = Path(__file__).resolve().parents[2]
SIM = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "workload.num_conversations=3", "workload.turns=2",
       "workload.output_len=4", "cluster.instances=1"]


def test_framework_names_no_plugin():
    keys = {k for registry in (PARALLELISM, MOE, ROUTING, COST, WORKLOAD) for k in registry.keys()}
    named = [f"{p.relative_to(ROOT)}: {k}" for p in (ROOT / "framework").rglob("*.py") for k in sorted(keys)
             if f'"{k}"' in (text := p.read_text()) or f"'{k}'" in text]
    assert not named, named


def test_a_plugins_describe_passes_through_whole(monkeypatch):
    """A key the parallelism plugin adds to describe() reaches results.json with no framework edit."""
    plugin = PARALLELISM.get("dp_attn")
    original = plugin.describe.__func__
    monkeypatch.setattr(plugin, "describe", classmethod(lambda cls, cfg: {**original(cls, cfg),
                                                                           "dp_balance": cfg.dp_balance.value}))
    results, _ = simulate(compose(SIM + ["parallel=dp_attn", "parallel.size=2", "moe=triton_fused"]))
    assert (results["parallel"], results["dp_size"], results["ffn_comm"]) == ("dp_attn", 2, "padded_all_gather")
    assert results["dp_balance"] == "round_robin"


@pytest.mark.parametrize("cost, hardware", [("calibrated", "this host"), ("roofline", "h200")])
def test_a_cost_model_describes_itself(cost, hardware):
    results, _ = simulate(compose(SIM + [f"sim/cost={cost}", "hardware=h200"]))
    assert (results["sim_cost_model"], results["sim_hardware"]) == (cost, hardware)
    assert results["sim_cost_config"]["name"] == cost
    assert COST.get(cost).reads_hardware == (hardware != "this host")


@pytest.mark.parametrize("override, allowed", [
    ("moe=ep moe.dispatch=bogus", "[all_to_all, all_reduce, "),   # + DeepEP's modes (priced in mode=sim)
    ("moe=triton_fused moe.kernel=cuda", "[auto, triton, torch]"),
    ("engine.schedule_policy=random", "[fcfs, lpm]"),
    ("engine.device=tpu", "[auto, cpu, cuda]"),
    ("parallel=dp_attn parallel.dp_balance=random", "[round_robin, shortest_queue, "),   # + servelab's prefix-aware ones
    ("parallel.backend=mpi", "[auto, gloo, nccl]"),
    ("model.gating=v4", "[v2, v3]"),
    ("model.weight_dtype=int4", "[fp8]"),
    ("router.tie_break=oldest", "[node_hash, least_loaded, most_recent, first]"),
    ("router.miss_policy=random", "[smallest_tree, least_loaded]"),
    ("router=precise_prefix router.miss_policy=random", "[least_loaded, smallest_cache, least_prefill]"),
    ("router=precise_prefix router.tokenizer=llama", "[byte]"),
    ("router=power_of_two router.load=queue", "[in_flight, worker_tokens]"),
])
def test_a_bogus_choice_fails_at_start_naming_the_allowed_values(capsys, override, allowed):
    with pytest.raises(SystemExit) as e:
        check_overrides(override.split())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected one of " + allowed in err and err.startswith("config error: ")


def test_choices_keep_their_values_from_the_command_line_to_results_json():
    cfg = compose(["moe=ep", "moe.dispatch=all_reduce", "engine.schedule_policy=fcfs", "model=deepseek_v3",
                   "router=cache_aware_v2", "parallel=dp_attn", "parallel.dp_balance=shortest_queue"])
    choices = {"dispatch": cfg.moe.dispatch, "kernel": cfg.moe.kernel, "schedule_policy": cfg.engine.schedule_policy,
               "gating": cfg.model.gating, "weight_dtype": cfg.model.weight_dtype, "tie_break": cfg.router.tie_break,
               "dp_balance": cfg.parallel.dp_balance}
    assert json.loads(json.dumps(choices)) == {"dispatch": "all_reduce", "kernel": "auto", "schedule_policy": "fcfs",
                                               "gating": "v3", "weight_dtype": "fp8", "tie_break": "least_loaded",
                                               "dp_balance": "shortest_queue"}
