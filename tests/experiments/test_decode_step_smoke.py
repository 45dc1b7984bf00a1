"""experiments/decode_step/bench.py smoke-runs at tiny size and writes a row per batch size and context."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_decode_step_bench_runs(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "experiments/decode_step/bench.py", "--batches", "1", "4", "--contexts", "8",
                        "16", "--steps", "3", "--repeats", "1", "--moe", "triton_fused", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["device"], result["moe"]) == ("cpu", "triton_fused")
    rows = result["rows"]
    assert [(row["batch"], row["context"]) for row in rows] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    assert all(0 < row["forward_ms"] <= row["step_ms"] and 0 < row["bookkeeping_frac"] < 1 for row in rows)
    assert "bookkeeping" in r.stdout
