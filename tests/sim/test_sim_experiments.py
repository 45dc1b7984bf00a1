"""The simulator's experiments smoke-run at tiny size (the real-engine ones are slow-marked)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.long
def test_sim_scale_smoke(tmp_path):
    r = _run("sim_scale/run.py", "--requests", "400", "--profile", "100", "--out", str(tmp_path),
             "cluster.instances=8")
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["requests_completed"] == 400 and out["instances"] == 8 and out["sim_cpu_s"] > 0
    assert "cumulative" in out["profile"] and "sim_requests_per_cpu_s" in r.stdout


@pytest.mark.slow
def test_calibrate_smoke(tmp_path):
    out = tmp_path / "c.json"
    _run("calibrate/run.py", "--quick", "--configs", "single", "--out", str(out))
    prof = json.loads(out.read_text())["profiles"]["singlex1/reference"]
    assert all(s > 0 for row in prof["decode"]["seconds"] for s in row)


@pytest.mark.long
def test_calibrate_serving_smoke(tmp_path):
    """A real worker's CPU outside its steps, at two answer lengths: a line whose terms price them again."""
    out = tmp_path / "c.json"
    _run("calibrate/serving.py", "--quick", "--out", str(out))
    serving = json.loads(out.read_text())["serving"]
    assert serving["request_cpu_s"] >= 0 and serving["token_cpu_s"] >= 0
    assert all(v > 0 for runs in serving["per_request_by_output"].values() for v in runs)
    for tokens, runs in serving["per_request_by_output"].items():
        if serving["request_cpu_s"] > 0 and serving["token_cpu_s"] > 0:   # neither term clamped at 0
            assert serving["request_cpu_s"] + serving["token_cpu_s"] * int(tokens) == pytest.approx(runs[0])


@pytest.mark.slow
def test_sim_fidelity_smoke(tmp_path):
    _run("sim_fidelity/run.py", "--quick", "--out", str(tmp_path), "--work", str(tmp_path / "runs"), timeout=900)
    out = json.loads((tmp_path / "results.json").read_text())
    assert {c["study"] for c in out["cases"]} == {"router_ablation", "dp_attn_vs_tp"}
    assert (tmp_path / "sim_vs_real.png").stat().st_size > 0


@pytest.mark.slow
def test_a_larger_simulation_is_deterministic_with_and_without_decode_runs():
    from framework.config import compose
    from framework.runs.sim import simulate
    base = ["experiment=sim_scale", "workload.num_conversations=1500", "cluster.instances=16"]
    a = simulate(compose(base))[1]
    b = simulate(compose(base + ["sim.fast_forward=false"]))[1]
    assert a == b and len(a) == 6000


@pytest.mark.long
def test_two_level_smoke(tmp_path):
    _run("two_level/run.py", "--quick", "--out", str(tmp_path))
    out = json.loads((tmp_path / "results.json").read_text())
    assert len(out["rows"]) == 9 and 0 < out["hit_rate_ceiling"] < 1
    assert all(r["requests_completed"] == 160 and r["cache_hit_rate"] <= out["hit_rate_ceiling"] for r in out["rows"])
    assert (tmp_path / "two_level.png").stat().st_size > 0
