"""experiments/roofline_validation/run.py runs end to end (its fitted terms go to a temporary folder)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.gpu.hardware import FIT_DIR

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_roofline_validation_runs(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "experiments/roofline_validation/run.py", "--out", str(out),
                        "--fit-dir", str(tmp_path / "fit")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(out.read_text())
    kinds = {(row["gpu"], row["kind"]) for row in results["validation"]}
    assert ("h100", "mlp_up_proj") in kinds and ("a100", "all_reduce x8 (NVLink)") in kinds
    assert {(row["weights"], row["parallel"]) for row in results["deepseek_v2_8xh100"]} == {
        (w, p) for w in ("model", "fp8") for p in ("tp", "dp_attn")}
    assert {row["kind"] for row in results["measured_gemms"]} == {"bfloat16 mm", "fp8 mm", "bfloat16 batched"}
    assert "| h100 | attn_pre_proj |" in r.stdout and "DeepSeek-V2 decode on 8x H100 SXM" in r.stdout
    assert sorted(p.name for p in (tmp_path / "fit").glob("*.json")) == sorted(p.name for p in FIT_DIR.glob("*.json"))
