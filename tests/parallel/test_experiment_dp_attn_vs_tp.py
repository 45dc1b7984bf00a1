"""experiments/dp_attn_vs_tp smoke-runs at tiny size, and its KV accounting is exact under both sizings: for one
KV budget per rank the DP attention instance holds parallel.size times the tokens of the TP instance; for one memory
budget per rank each scheme's KV is what its declared weights leave."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.engine.engine import plan_memory
from framework.core.registry import MOE, PARALLELISM
from parallel_helpers import make_cfg

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_the_experiment_runs_tiny_and_its_kv_accounting_is_exact(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "experiments/dp_attn_vs_tp/run.py", "--tiny", "--out", str(out),
                           "--work", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp_attn/tp" in done.stdout and "KV tok/instance" in done.stdout
    result = json.loads(out.read_text())
    s, size = result["summary"], 2
    kv = f"kv_budget_x{size}"
    assert s[f"{kv}_dp_attn_kv_capacity_tokens_per_rank"] == s[f"{kv}_tp_kv_capacity_tokens_per_rank"]
    assert s[f"{kv}_dp_attn_over_tp_kv_capacity_tokens_instance"] == size
    assert s[f"{kv}_tp_idle_steps"] == 0
    budget = [o for o in result["sizings"]["mem_budget"] if o.startswith("engine.mem_budget_mb=")]
    for scheme in ("tp", "dp_attn"):
        cfg = make_cfg(*result["overrides"], *budget, f"parallel={scheme}", f"parallel.size={size}")
        plan = plan_memory(cfg.model, cfg.engine, PARALLELISM.get(scheme), cfg.parallel, MOE.get(cfg.moe.name),
                           cfg.moe)
        assert s[f"mem_budget_x{size}_{scheme}_weight_bytes_per_rank"] == plan.weight_bytes_total
        assert s[f"mem_budget_x{size}_{scheme}_kv_capacity_tokens_per_rank"] == plan.kv_tokens
    mem = f"mem_budget_x{size}"
    assert s[f"{mem}_dp_attn_kv_capacity_tokens_per_rank"] < s[f"{mem}_tp_kv_capacity_tokens_per_rank"]
    assert 1 < s[f"{mem}_dp_attn_over_tp_kv_capacity_tokens_instance"] < size
    assert {r["kv_sizing"] for r in result["runs"]} == {"kv_budget", "mem_budget"}
