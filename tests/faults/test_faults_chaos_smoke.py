"""experiments/chaos smoke-runs at tiny size (a cluster start and one scenario) and writes its table's figures."""
import json
import subprocess
import sys

import pytest

from cluster_helpers import ROOT, free_port_block


@pytest.mark.slow
def test_chaos_quick(tmp_path):
    r = subprocess.run([sys.executable, "experiments/chaos/run.py", "--quick", "--scenarios", "baseline",
                        "sigkill_worker", "--out", str(tmp_path), "--port", str(free_port_block(6))],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    print(r.stdout)
    assert [x["scenario"] for x in runs] == ["baseline", "sigkill_worker"]
    assert all(x["requests"] == 32 and x["lost"] == 0 for x in runs)
    assert runs[1]["worker_restarts"] == 1 and runs[1]["recovery_s"] > 0
    assert all(abs(x["estimated_hit_rate"] - x["measured_hit_rate"]) <= 0.02 for x in runs)
    assert "| scenario | requests | lost |" in r.stdout
