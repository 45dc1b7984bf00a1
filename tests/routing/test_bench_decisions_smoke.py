"""The decision benchmark runs end to end at a tiny size and writes the figures it prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_router" / "bench_decisions.py"


@pytest.mark.long  # a subprocess run of an experiments script (~5 s): CI's long set keeps it
def test_bench_decisions_smoke(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--conversations", "6", "--turns", "5", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["requests"] == 30
    for key in ("cache_aware", "round_robin", "random"):
        assert sum(v for k, v in r.items() if k.startswith(f"{key}_decisions_")) == 30
        assert 0 < r[f"{key}_decision_median_us"] <= r[f"{key}_decision_p99_us"]
    # later turns extend earlier ones on the same worker: most of each request is already there
    assert r["cache_aware_estimated_hit_rate"] > 0.5 and r["round_robin_estimated_hit_rate"] == 0
    assert r["cache_aware_tree_chars_after_eviction"] < r["cache_aware_tree_chars_before_eviction"]
    assert "cache_aware" in proc.stdout and "eviction pass" in proc.stdout
    # the yardstick made the same decisions, so its time per decision is comparable
    assert r["cache_aware_same_decisions_as_plain_tree"] is True
    assert r["plain_tree_estimated_hit_rate"] == r["cache_aware_estimated_hit_rate"]
    assert r["cache_aware_over_plain_tree_median_ratio"] > 0 and "x plain tree" in proc.stdout
