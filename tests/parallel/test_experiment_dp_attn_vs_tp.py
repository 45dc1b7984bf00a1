"""experiments/dp_attn_vs_tp smoke-runs at tiny size, and its KV accounting is exact: for one per-rank budget the
DP attention instance holds parallel.size times the tokens of the TP instance."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_experiment_runs_tiny_and_dp_attention_holds_size_times_the_kv(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "experiments/dp_attn_vs_tp/run.py", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp_attn/tp" in done.stdout and "KV tok/instance" in done.stdout
    s = json.loads(out.read_text())["summary"]
    size = 2
    assert s[f"x{size}_dp_attn_kv_capacity_tokens_per_rank"] == s[f"x{size}_tp_kv_capacity_tokens_per_rank"]
    for scheme in ("dp_attn", "dp_attn_c1"):
        assert s[f"x{size}_{scheme}_over_tp_kv_capacity_tokens_instance"] == size
        assert s[f"x{size}_{scheme}_over_tp_max_running_requests"] >= 1
    assert s[f"x{size}_tp_idle_steps"] == 0
