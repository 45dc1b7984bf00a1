"""experiments/bench_router/bench_http.py runs end to end at a tiny size: every installed proxy (servelab's router,
on uvloop too, SGLang's router, the bare proxy) in front of the same stubs, and writes the figures it prints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_router" / "bench_http.py"


@pytest.mark.long
def test_bench_http_smoke(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1", "--c1-requests", "40", "--c256-requests", "400",
                           "--phase-max-s", "0.5", "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["proxies"][0] == "router" and "bare" in r["proxies"]
    for name in r["proxies"]:
        assert r[f"{name}_throughput_c256_req_s"] > 0 and r[f"{name}_cpu_us_per_req_c256"] > 0
        assert r[f"{name}_harness_cpu_us_per_req_c256"] > 0  # the client and the stubs work for every request
    assert "CPU per request, c=256 (us)" in proc.stdout
    assert {"cpu_model", "cpu_cache", "loadavg_1m_before_after", "steal_cores"} <= set(r["host"])
