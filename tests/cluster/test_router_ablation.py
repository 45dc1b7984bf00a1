"""experiments/router_ablation smoke-runs at tiny size and writes its table's figures."""
import json
import subprocess
import sys

from cluster_helpers import ROOT, free_port_block


def test_router_ablation_quick(tmp_path):
    r = subprocess.run([sys.executable, "experiments/router_ablation/run.py", "--quick", "--out", str(tmp_path),
                        "--port", str(free_port_block(3)), "--workloads", "shared_prefix",
                        "--policies", "round_robin", "cache_aware"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    print(r.stdout)                      # the table, shown when an assertion below fails
    assert [(x["workload"], x["router"]) for x in runs] == [("shared_prefix", "round_robin"),
                                                            ("shared_prefix", "cache_aware")]
    assert all(x["requests_completed"] == 8 and x["requests_failed"] == 0 for x in runs)
    assert runs[0]["hit_rate_vs_rr"] == 1.0 and runs[0]["router_estimated_hit_rate"] == 0.0
    # one request at a time and caches that hold everything: the router's tree and the engines' radix caches agree
    assert abs(runs[1]["router_estimated_hit_rate"] - runs[1]["cache_hit_rate"]) < 0.05
    assert runs[1]["cache_hit_rate"] > runs[0]["cache_hit_rate"]
    assert "tput x RR" in r.stdout
