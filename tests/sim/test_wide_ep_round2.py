"""Issue 21, round 2: the expert loads replayed from SGLang's published DeepSeek-V3 distribution, and the one EPLB /
two-batch-overlap order the MoE backend and the cost model share (framework/contracts)."""
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from framework.contracts import eplb as shared_eplb
from framework.contracts import tbo as shared_tbo
from plugins.cost.lib import expert_load
from plugins.cost.lib import tbo as cost_tbo
from plugins.moe.lib import tbo as moe_tbo
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
WIDE_EP = ROOT / "experiments" / "wide_ep"
LOADS = {phase: WIDE_EP / "loads" / f"sglang_blog_{phase}.json" for phase in ("prefill", "decode")}


@pytest.mark.parametrize("phase", LOADS)
def test_the_replayed_loads_are_deepseek_v3s_moe_layers_with_their_source(phase):
    data = json.loads(LOADS[phase].read_text())
    rows = expert_load.read_loads(str(LOADS[phase]), 256)
    assert sorted(int(k.removeprefix("layer")) for k in data["expert_load"]) == list(range(3, 61))
    assert all(sum(r) == pytest.approx(1.0, abs=1e-4) and min(r) >= 0 for r in rows)
    png = WIDE_EP / "loads" / "sglang_blog_eplb_stat.png"
    assert data["png_sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
    assert "eplb-stat.png" in data["source"] and data["license"].startswith("MIT")
    # a skewed map: the hottest expert of a layer far above the mean, and EPLB flattens the ranks
    assert max(max(r) for r in rows) * 256 > 5
    r = rows[40]
    assert expert_load.rank_imbalance(r, expert_load.rebalance(r, 288, 32), 32) < \
        0.5 * expert_load.rank_imbalance(r, list(range(256)), 32)


def test_the_cost_model_places_experts_with_the_backends_eplb():
    rng = random.Random(3)
    for ranks, slots in ((16, 288), (32, 288), (72, 288), (8, 256)):
        loads = [rng.paretovariate(1.2) for _ in range(256)]
        assert expert_load.rebalance(loads, slots, ranks) == shared_eplb.rebalance(loads, slots, 1, 1, ranks, "global")


def test_the_backend_and_the_cost_model_run_one_overlap_order():
    assert moe_tbo.schedule is shared_tbo.schedule and moe_tbo.delta_stages is shared_tbo.delta_stages
    layer = cost_tbo.decode_layer(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    assert len(layer) == len(shared_tbo.DECODE_STAGES)
    assert layer[1] == [("compute", 5.0)] and layer[3] == [("recv", "dispatch"), ("compute", 5.0),
                                                             ("send", "combine", 7.0)]
    assert cost_tbo.prefill_layer(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)[0] == [("compute", 6.0), ("send", "dispatch", 6.0)]


def test_compare_reads_round_2_into_its_own_file(tmp_path, monkeypatch):
    """On made-up figures (the real round-2 comparison is the lead's, after the prediction is committed)."""
    compare = load_script(WIDE_EP / "compare.py")
    cells = {cell: {"value": 1.0} for cell, *_ in compare.PUBLISHED}
    (tmp_path / "predictions_round2.json").write_text(json.dumps({"cells": cells}))
    monkeypatch.setattr(compare, "HERE", tmp_path)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--round", "2"])
    compare.main()
    out = json.loads((tmp_path / "comparison_round2.json").read_text())
    assert out["round"] == 2 and [r["cell"] for r in out["rows"]] == [c for c, *_ in compare.PUBLISHED]
    assert not (tmp_path / "comparison.json").exists()


@pytest.mark.long
def test_the_digitizer_rewrites_the_committed_loads_exactly(tmp_path):
    before = {p: p.read_bytes() for p in LOADS.values()}
    done = subprocess.run([sys.executable, str(WIDE_EP / "digitize_loads.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {p: p.read_bytes() for p in LOADS.values()} == before
