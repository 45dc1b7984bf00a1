"""experiments/sim_fidelity/step_shapes.py: a step log whose CPU is exactly half of one pricing's price reads that
pricing's shape as right (ratio 0.5 in every bin, no shape error) and the other's as off where they differ."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from framework.contracts.cost import BatchShape, decode_shape
from framework.core.paths import REPO_ROOT as ROOT
from script_loader import load_script

STEPS = [BatchShape("extend", (112, 112, 112, 112), (0, 0, 0, 0)), BatchShape("extend", (300,), (10,)),
         BatchShape("extend", (96, 200), (400, 300)), decode_shape(1, 300), decode_shape(6, 2000)]


def test_a_log_at_half_the_per_request_price_reads_no_shape_error_there_and_some_for_batch(tmp_path):
    s = load_script("experiments/sim_fidelity/step_shapes.py")
    half = [0.5 * p for p in s.priced([(x, 0.0) for x in STEPS], "per_request", s.sim_args())]
    (tmp_path / "steps.1.0.jsonl").write_text("".join(
        json.dumps({"rank": 0, "size": 1, "dp_rank": 0, "cpu_s": c, "batches": [dataclasses.asdict(x)]}) + "\n"
        for x, c in zip(STEPS, half)))
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/step_shapes.py", "--steps", str(tmp_path / "steps"),
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["steps_logged"] == len(STEPS)
    per, batch = res["priced"]["per_request"], res["priced"]["batch"]
    assert all(row["ratio"] == pytest.approx(0.5) for row in per["bins"].values())
    assert per["shape_error"] == pytest.approx({"extend": 0.0, "decode": 0.0}, abs=1e-9)
    assert batch["bins"]["extend r1 n>256 p<=16"]["ratio"] == pytest.approx(0.5)      # one request: the same price
    assert batch["bins"]["extend r3+ n>256 p<=16"]["ratio"] < 0.5                      # four as one of 448: dearer
    assert batch["shape_error"]["extend"] > 0.05
    (tmp_path / "steps.2.0.jsonl").write_text(json.dumps(        # a two-rank instance's step: refused, saying why
        {"rank": 1, "size": 2, "dp_rank": 0, "cpu_s": 0.01, "batches": [dataclasses.asdict(STEPS[0])]}) + "\n")
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/step_shapes.py", "--steps", str(tmp_path / "steps"),
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "reads one-rank engines only" in r.stderr
