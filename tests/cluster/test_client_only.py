"""Client-only mode, as a user runs it: `python run.py cluster.url=...` drives a server started elsewhere (here a real
cluster's router, or one of its workers directly) and starts nothing."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from cluster_helpers import ROOT, compose
from framework.app import run as app_run
from framework.core.errors import UserError
from framework.cluster.cluster import Cluster

SMALL = ["workload=shared_prefix", "workload.num_groups=2", "workload.prompts_per_group=3",
         "workload.system_prompt_len=64", "workload.question_len=8", "workload.output_len=4",
         "workload.max_concurrency=2", "logger.mode=disabled"]


def run(tmp_path, *overrides):
    return subprocess.run([sys.executable, "run.py", f"hydra.run.dir={tmp_path}", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(compose("cluster.instances=2", "router.port=0", "engine.kv_budget_mb=1")) as c:
        yield c


@pytest.mark.long
def test_drives_a_router_started_elsewhere(cluster, tmp_path):
    r = run(tmp_path, f"cluster.url={cluster.router_url}", "workload.api=completions", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["target_url"] == cluster.router_url and results["api"] == "completions"
    assert results["requests_completed"] == 6 and results["cache_hit_rate"] > 0.3
    assert sorted(results["per_worker"]) == sorted(cluster.worker_urls)        # the router named each worker
    assert sum(w["requests"] for w in results["per_worker"].values()) == 6
    assert set(results["worker_load_timeline"]["in_flight"]) == set(cluster.worker_urls)
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line)["worker"] in cluster.worker_urls for line in lines)
    assert (tmp_path / "worker_load.png").is_file()


@pytest.mark.long  # a whole cluster (README's test command stays under its 5 minutes)
def test_drives_one_server_directly_and_refuses_what_it_cannot(cluster, tmp_path):
    """In-process this time (framework.app.run, what run.py calls)."""
    worker = cluster.worker_urls[0]
    out = run_app(tmp_path, f"cluster.url={worker}", "workload.api=chat")
    results = json.loads((tmp_path / "results.json").read_text())
    assert out == results["output_throughput_tok_s"] > 0
    assert results["requests_completed"] == 6 and "per_worker" not in results      # one server: no router figures
    with socket.socket() as bound_not_listening:  # holds a port on which every connection is refused
        bound_not_listening.bind(("127.0.0.1", 0))
        with pytest.raises(UserError, match="nothing accepts connections"):
            run_app(tmp_path, f"cluster.url=http://127.0.0.1:{bound_not_listening.getsockname()[1]}")
    with pytest.raises(UserError, match="not an http"):
        run_app(tmp_path, "cluster.url=localhost:30000")
    with pytest.raises(UserError, match="drop cluster.url"):
        run_app(tmp_path, f"cluster.url={worker}", "mode=serve")


def run_app(tmp_path, *overrides) -> float:
    return app_run(compose(*SMALL, *overrides), str(tmp_path), {})
