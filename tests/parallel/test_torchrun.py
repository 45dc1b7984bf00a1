"""The same instance code under torchrun (one process per rank, as on several nodes): rank 0 runs its rank loop in
a thread beside the verify driver; the other ranks serve until rank 0 stops them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "dp_attn"])
def test_verify_passes_under_torchrun(tmp_path, parallel):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "run.py",
           "mode=verify", f"parallel={parallel}", "parallel.size=2", "logger.mode=disabled",
           f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["verify_passed"] and results["parallel_size"] == 2
    assert results["verify_max_abs_err"] <= 1e-4
