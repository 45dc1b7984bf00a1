"""experiments/bench_router/bench_path.py drives the router's request path in process (its own server connection and
pooled worker connections on transports that keep what is written): every request reaches a worker and is answered
200, and the counts it reports are real (a path that skipped the router would count no bytecodes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_router" / "bench_path.py"


@pytest.mark.long
def test_bench_path_smoke(tmp_path):
    out = tmp_path / "path.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "200", "--reps", "1", "--opcodes",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["us_per_request_median"] > 0
    assert r["bytecodes_per_request"] > 500 and r["python_calls_per_request"] > 20
    assert "CPU per request" in proc.stdout
