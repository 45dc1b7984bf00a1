"""experiments/scheduler_fidelity/run.py smoke-runs at tiny size: both scenarios, SGLang's rules and the switch."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_scheduler_fidelity_replay_runs(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "experiments/scheduler_fidelity/run.py", "--tiny", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(row["scenario"], row["variant"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(s, v) for s in ("shared_prefix", "burst") for v in ("sglang", "alternate_extend_decode")}
    # the switch interleaves decodes: no request waits more than 2 steps between tokens
    assert rows["burst", "alternate_extend_decode"]["max_decode_stall_steps"] == 2
    assert rows["burst", "sglang"]["max_decode_stall_steps"] > 2
    assert rows["shared_prefix", "sglang"]["hit_rate"] > 0
