"""experiments/sim_repro/compare.py judges a pre-registered prediction: errors and the 20% / 15% targets."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
_compare = load_script("experiments/sim_repro/compare.py")
PUBLISHED, compare = _compare.PUBLISHED, _compare.compare


def predictions(scale: dict) -> dict:
    return {"round": 7, "git_sha": "abc", "predictions": {c: {"figure": v * scale.get(c, 1.0), "unit": "tok/s"}
                                                          for c, v in PUBLISHED.items()}}


def test_cells_and_ratios_pass_within_their_targets_and_fail_beyond():
    exact = compare(predictions({}))
    assert all(c["pass"] and c["error"] == pytest.approx(0) for c in exact["cells"])
    off = compare(predictions({"pr1970/decode/tp": 1.25, "pr1970/prefill/dp_attn": 0.82}))
    verdict = {c["cell"]: c["pass"] for c in off["cells"]}
    assert not verdict["pr1970/decode/tp"] and verdict["pr1970/prefill/dp_attn"]
    ratios = {r["ratio"]: r for r in off["ratios"]}
    assert ratios["pr1970/decode dp_attn / tp"]["error"] == pytest.approx(1 / 1.25 - 1)
    assert not ratios["pr1970/decode dp_attn / tp"]["pass"] and not ratios["pr1970/prefill dp_attn / tp"]["pass"]
    assert ratios["pr2170/cache_aware / round_robin"]["pass"] is None       # shown, not judged


def test_a_prediction_missing_a_cell_is_refused(tmp_path):
    pred = predictions({})
    del pred["predictions"]["pr2170/cache_aware"]
    path = tmp_path / "predictions_round7.json"
    path.write_text(json.dumps(pred))
    out = subprocess.run([sys.executable, str(ROOT / "experiments/sim_repro/compare.py"), str(path)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no figure for pr2170/cache_aware" in out.stderr
