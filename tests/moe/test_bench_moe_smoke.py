"""experiments/bench_moe/bench.py smoke-runs at tiny size: one table, results.json with a ratio for every cell, and
the fused kernel's own timing (interpreted here: tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_bench_moe_runs_and_writes_results(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/bench_moe/bench.py"), "--shapes", "tiny",
                           "--sizes", "1", "--batch-sizes", "1,4", "--budget-s", "0.001", "--runs", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "ep_all_to_all" in proc.stdout and "B=4" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert {(r["backend"], r["batch_tokens"]) for r in records} == {
        (b, n) for b in ("reference", "triton_fused", "ep_all_to_all", "ep_all_reduce") for n in (1, 4)}
    assert all(r["tok_s"] > 0 and r["ratio_vs_reference"] > 0 for r in records)
    kernel = [r for r in records if "kernel_us" in r]
    assert {r["batch_tokens"] for r in kernel} == {1, 4} and {r["backend"] for r in kernel} == {"triton_fused"}
    assert all(r["kernel_us"] > 0 and r["weight_gbs"] > 0 for r in kernel)
    assert "fused kernel alone, tiny x1 B=4" in proc.stdout
