"""EPLB on a skewed router, real (the measurement of experiments/eplb at its smallest): moe=ep's all-to-all on 2
gloo ranks, the tiny model's MoE layer with a router biased toward rank 0's experts. The (token, expert) pairs the
slowest rank computes drop once EPLB has re-placed the experts from the recorded loads; every pair is still computed
once (the sums agree)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_eplb_lowers_the_slowest_ranks_pairs_on_a_skewed_router(tmp_path):
    done = subprocess.run([sys.executable, "experiments/eplb/run.py", "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["placement"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    v04 = rows.pop("v0.4 contiguous blocks")
    assert v04["imbalance"] > 1.5 and v04["experts_moved"] == 0          # the skew lands on rank 0
    for name, r in rows.items():
        assert sum(r["pairs_per_rank"]) == sum(v04["pairs_per_rank"]), name
        assert r["slowest_rank_pairs"] < 0.8 * v04["slowest_rank_pairs"], (name, r["pairs_per_rank"])
        assert r["rebalances"] >= 1 and r["experts_moved"] > 0 and r["bytes_moved"] > 0, name
