"""`run.py` end to end, as a user runs it: results.json, the table, W&B offline, verify, clear refusals."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path, *overrides, timeout=300):
    return subprocess.run([sys.executable, "run.py", f"hydra.run.dir={tmp_path}", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.long  # run.py end to end (~10-25 s): CI's second command; README's run is near 5 min
def test_bench_writes_results_and_offline_wandb(tmp_path):
    r = run(tmp_path, "workload.num_conversations=4", "workload.turns=2", "logger.mode=offline", "router.port=0")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["per_worker"]) == 2 and not any(u.endswith(":30001") for u in results["per_worker"])
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 8          # one line per request
    for key in ("requests_completed", "requests_failed", "request_throughput_req_s", "input_throughput_tok_s",
                "output_throughput_tok_s", "cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                "e2e_p50_ms", "e2e_p99_ms", "kv_bytes_per_token_per_rank", "kv_capacity_tokens_per_rank",
                "max_running_requests", "git_sha"):
        assert key in results, key
    assert results["requests_completed"] == 8 and results["requests_failed"] == 0
    assert results["cache_hit_rate"] > 0.3                # shared system prompt + conversation history
    assert results["kv_bytes_per_token_per_rank"] == 1280
    assert "output_throughput_tok_s" in r.stdout           # the console table
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    media = run_dir / "files" / "media"            # tables as wandb.Table, the run's plots as wandb.Image
    tables = {p.name.split("_0_")[0] for p in (media / "table").glob("*.table.json")}
    assert {"per_worker", "expert_load", "worker_load_timeline"} <= tables
    assert {p.name.split("_0_")[0] for p in (media / "images" / "plots").glob("*.png")} == {"worker_load",
                                                                                           "expert_load"}
    assert {p.name for p in tmp_path.glob("*.png")} == {"worker_load.png", "expert_load.png"}


@pytest.mark.long
def test_verify_passes_and_num_requests_caps(tmp_path):
    r = run(tmp_path, "mode=verify", "logger.mode=disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verify passed" in r.stdout
    assert json.loads((tmp_path / "results.json").read_text())["verify_max_abs_err"] < 1e-4
    r = run(tmp_path / "cap", "workload.num_requests=3", "logger.mode=disabled")
    assert r.returncode == 0 and json.loads((tmp_path / "cap" / "results.json").read_text())["requests_completed"] == 3


@pytest.mark.long
def test_verify_fails_above_atol(tmp_path):
    r = run(tmp_path, "mode=verify", "verify.atol=1e-12", "logger.mode=disabled")
    assert r.returncode != 0 and "verify failed" in r.stderr


@pytest.mark.long
def test_mode_sim_with_the_cost_model_as_users_type_it(tmp_path):
    r = run(tmp_path, "mode=sim", "sim.cost=roofline", "model.weight_dtype=fp8", "logger.mode=disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sim_cost_model"] == "roofline" and results["sim_model"]["weight_dtype"] == "fp8"
    assert results["requests_completed"] > 0 and (tmp_path / "requests.jsonl").exists()
