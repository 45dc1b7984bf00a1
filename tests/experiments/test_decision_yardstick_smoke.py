"""experiments/soak/decision_yardstick.py plays the soak's trace through the simulated router with patches of its own
(the router's ``send``, the core's ``dispatch``, the policies' parts): a change of those signatures broke it once with
no test failing. Each mode runs here once, on one replay: the timed p50s, the parts, the recorded decisions compared
with themselves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "soak" / "decision_yardstick.py"


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--replays", "1", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.long
def test_the_timed_runs_and_their_ratio(tmp_path):
    out = tmp_path / "y.json"
    run("--runs", "1", "--routers", "cache_aware", "precise_prefix", "--out", str(out))
    rows = {r["router"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["cache_aware"]["ratio"] == 1.0
    assert rows["precise_prefix"]["p50_us"] > 0 and rows["precise_prefix"]["ratio"] > 0


@pytest.mark.long
def test_the_parts_and_the_recorded_decisions(tmp_path):
    parts = run("--runs", "1", "--parts", "--routers", "precise_prefix")
    for part in ("hashing", "keys", "match", "credit", "decision", "dispatch"):
        assert f" {part} " in parts
    for d in ("a", "b"):
        run("--record", str(tmp_path / d), "--routers", "precise_prefix")
    same = run("--compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert "precise_prefix" in same and "the same" in same
