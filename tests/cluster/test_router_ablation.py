"""experiments/router_ablation smoke-runs at tiny size and writes its table's figures."""
import json
import subprocess
import sys

import pytest

from cluster_helpers import ROOT
from framework.cluster.peer_router import installed_version


@pytest.mark.long
def test_router_ablation_quick(tmp_path):
    """servelab's router, and SGLang's beside it when installed (it cannot run v0.4's cache_aware: skipped)."""
    impls = ["servelab", "sglang"] if installed_version() else ["servelab"]
    r = subprocess.run([sys.executable, "experiments/router_ablation/run.py", "--quick", "--out", str(tmp_path),
                        "--workloads", "shared_prefix", "--policies", "round_robin", "cache_aware",
                        "--impls", *impls], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    print(r.stdout)                      # the table, shown when an assertion below fails
    if "sglang" in impls:
        sglang_rr = runs.pop(1)
        assert (sglang_rr["router"], sglang_rr["impl"], sglang_rr["requests_completed"]) == ("round_robin", "sglang", 8)
        # its CPU comes from /proc in 10 ms ticks: 8 requests of a Rust router may take less than one
        assert sglang_rr["load_imbalance"] == 1.0 and sglang_rr["router_cpu_us_per_req"] >= 0
        assert "skipped cache_aware on sglang" in r.stdout
    assert [(x["workload"], x["router"], x["impl"]) for x in runs] == [("shared_prefix", "round_robin", "servelab"),
                                                                      ("shared_prefix", "cache_aware", "servelab")]
    assert all(x["requests_completed"] == 8 and x["requests_failed"] == 0 for x in runs)
    assert runs[0]["hit_rate_vs_rr"] == 1.0 and runs[0]["router_estimated_hit_rate"] == 0.0
    # one request at a time and caches that hold everything: the router's tree and the engines' radix caches agree
    assert abs(runs[1]["router_estimated_hit_rate"] - runs[1]["cache_hit_rate"]) < 0.05
    assert runs[1]["cache_hit_rate"] > runs[0]["cache_hit_rate"]
    assert "tput x RR" in r.stdout
