"""A real cluster on loopback: worker processes with real engines behind the router process, driven over HTTP."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cluster_helpers import ROOT, cluster_cfg, compose, descendants, free_port_block, group_alive
from framework.core.registry import WORKLOAD
from framework.cluster.cluster import Cluster
from framework.core.errors import ClusterError
from framework.runs.bench import run_cluster_bench
from framework.cluster.figures import bench, cluster_figures
from framework.load.http_client import LoadClient

SHARED_PREFIX = ["workload=shared_prefix", "workload.num_groups=4", "workload.prompts_per_group=4",
                 "workload.system_prompt_len=128", "workload.question_len=16", "workload.output_len=4",
                 "workload.max_concurrency=1"]


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Every pid has exited (a zombie waiting for init to reap it counts as exited)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in pids:
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(p)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def cluster_processes() -> list[int]:
    pids = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"framework.cluster.proc" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


@pytest.fixture(scope="module")
def cluster():
    cfg = cluster_cfg(2, "router=cache_aware", *SHARED_PREFIX)
    with Cluster(cfg) as c:
        yield c, cfg


@pytest.mark.long  # a whole cluster (README's test command stays under its 5 minutes)
def test_workload_through_router_and_two_workers(cluster, tmp_path):
    """Sequential shared-prefix requests through cache_aware: each group stays on one worker, so every request but
    each group's first finds the group's system prompt in that worker's cache, as the worker reports it."""
    c, cfg = cluster
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    results, records = bench(c, cfg, sessions)
    assert results["requests_completed"] == 16 and results["requests_failed"] == 0
    group_prefix = cfg.workload.system_prompt_len + 2
    firsts = {}
    for s, r in zip(sessions, records):               # max_concurrency=1: records come back in session order
        assert r.prompt_tokens == len(s.prompt(0, [])) and r.completion_tokens == 4
        assert 0 < r.engine_ttft_s < r.ttft_s          # the worker's own TTFT; the rest: client, router, HTTP
        firsts.setdefault(s.prefix, []).append(r.cached_tokens)
    for cached in firsts.values():
        assert cached[0] < group_prefix and all(x >= group_prefix for x in cached[1:])
    per_worker = results["per_worker"]
    assert set(per_worker) == set(c.worker_urls)
    assert sum(w["requests"] for w in per_worker.values()) == 16
    assert sum(w["cached_tokens"] for w in per_worker.values()) == sum(r.cached_tokens for r in records)
    assert min(w["requests"] for w in per_worker.values()) > 0          # groups spread over both workers
    assert results["load_imbalance"] == max(w["requests"] for w in per_worker.values()) / 8
    assert 0.5 < results["cache_hit_rate"] < 1 and 0.5 < results["router_estimated_hit_rate"] < 1
    assert results["router_decision_p50_us"] > 0 and results["router_retries"] == 0
    assert results["outside_mean_ms"] == pytest.approx(1e3 * sum(r.ttft_s - r.engine_ttft_s for r in records) / 16)
    # the engines' KV figures: 1 MB of 1,280-byte tokens (the tiny MLA model's latent + RoPE key, 4 layers, fp32)
    assert results["kv_bytes_per_token_per_rank"] == 1280 and results["kv_capacity_tokens_per_rank"] == 2**20 // 1280
    assert results["max_running_requests"] >= 1 and results["retractions"] == 0


@pytest.mark.long
def test_run_cluster_bench_fronting_external_worker_urls(cluster, tmp_path):
    """cluster.workers: no local instances, the router in front of servers given by URL (here the module's);
    run_cluster_bench writes results.json through framework.report.metrics.report."""
    c, _ = cluster
    cfg = compose(f"router.port={free_port_block(1)}", "router=round_robin", *SHARED_PREFIX,
                  f"cluster.workers=[{','.join(c.worker_urls)}]", "workload.num_requests=4")
    assert Cluster(cfg).worker_urls == c.worker_urls
    assert run_cluster_bench(cfg, str(tmp_path), {"router": "round_robin"}) > 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [w["requests"] for w in results["per_worker"].values()] == [2, 2]
    assert results["requests_completed"] == 4 and results["requests_failed"] == 0
    assert json.loads((tmp_path / "config.json").read_text()) == {"router": "round_robin"}
    assert all(w.popen.poll() is None for w in c.workers)          # external workers are not stopped


@pytest.mark.long
def test_killed_worker_mid_run_every_request_completes_and_nothing_is_left(tmp_path):
    """Unsupervised (cluster.restart_workers=false): the dead worker stays down and the other serves the rest."""
    cfg = cluster_cfg(2, "router=cache_aware", "workload=multi_turn", "workload.num_conversations=8",
                      "workload.turns=3", "workload.system_prompt_len=32", "workload.user_len=48",
                      "workload.output_len=16", "workload.max_concurrency=8", "cluster.restart_workers=false")
    sessions = WORKLOAD.build("multi_turn", cfg.workload, 0).sessions()
    before = set(cluster_processes())          # the module's cluster is still up
    with Cluster(cfg) as c:
        groups = [w.popen.pid for w in c.workers] + [c.router.popen.pid]
        client = LoadClient(c.router_url, cfg.workload, retries=2, request_timeout_s=60)
        out = {}
        player = threading.Thread(target=lambda: out.update(result=client.play(sessions)))
        player.start()
        deadline = time.monotonic() + 30
        while len(client.records) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        done_at_kill = len(client.records)
        c.kill_worker(0)
        c.workers[0].popen.wait()
        player.join(60)
        records, _ = out["result"]
        figures = cluster_figures(records, c.worker_urls, c.router_stats(), c.worker_infos())
    assert len(records) == 24 and all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert figures["router_retries"] + client.retries >= 1            # something was in flight on the dead worker
    assert "error" in figures["per_worker"][c.worker_urls[0]]          # it is gone...
    served = [figures["per_worker"][u]["requests"] for u in c.worker_urls]
    assert sum(served) == 24 and served[0] <= done_at_kill + 2          # ...and the other served the rest
    assert set(cluster_processes()) == before and not any(group_alive(g) for g in groups)


def test_port_in_use_is_one_clear_error():
    before = cluster_processes()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cfg = cluster_cfg(1, f"cluster.worker_ports=[{taken}]")
        with pytest.raises(ClusterError, match=rf"port {taken} on 127.0.0.1 for worker 0"):
            Cluster(cfg).start()
    assert cluster_processes() == before


@pytest.mark.long  # a whole cluster (README's test command stays under its 5 minutes)
def test_a_worker_that_cannot_start_is_named(tmp_path):
    cfg = cluster_cfg(1, "engine.kv_budget_mb=0.0001")   # a valid setting whose KV pool holds no token: the worker fails
    before = cluster_processes()
    with pytest.raises(ClusterError, match=r"worker 0 \(http://127.0.0.1:\d+\) failed to start: ValueError: "
                                           r"the KV pool holds no token"):
        run_cluster_bench(cfg, str(tmp_path), {})
    assert cluster_processes() == before


def test_startup_timeout_names_the_worker_and_leaves_nothing():
    cfg = cluster_cfg(1, "cluster.startup_timeout_s=0.3")
    before = cluster_processes()
    with pytest.raises(ClusterError, match=r"worker 0 .* did not come up within cluster.startup_timeout_s=0.3s"):
        with Cluster(cfg):
            pass
    assert cluster_processes() == before


SERVE = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from cluster_helpers import compose
from framework.runs.serve import serve_cluster
serve_cluster(compose("cluster.instances=1", "router.port={port}", "engine.kv_budget_mb=1"))
"""


@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_serve_stops_everything_on_ctrl_c_or_when_killed(sig):
    """Ctrl-C stops the cluster cleanly; a parent killed outright takes its children with it (PR_SET_PDEATHSIG)."""
    port = free_port_block(2)
    script = SERVE.format(root=str(ROOT), tests=str(ROOT / "tests" / "cluster"), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("router:"):
            break
    assert lines and lines[-1].startswith(f"router: http://127.0.0.1:{port}"), "".join(lines)
    children = descendants(proc.pid)
    assert len(children) == 2                      # one worker, one router
    from framework.cluster.cluster import http_json
    assert http_json("GET", f"http://127.0.0.1:{port}/health")["healthy_workers"] == 1
    proc.send_signal(sig)
    proc.wait(30)
    if sig == signal.SIGINT:
        assert proc.returncode == 0, proc.stdout.read()
    deadline = time.monotonic() + 20
    while any(group_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(group_alive(c) for c in children)


@pytest.mark.long
def test_a_multi_rank_instance_serves_behind_the_router():
    """parallel.size=2: the worker fronts a two-rank DP-attention instance (its ranks join the worker's group)."""
    cfg = cluster_cfg(1, "parallel=dp_attn", "parallel.size=2", *SHARED_PREFIX, "workload.num_requests=4",
                      "workload.max_concurrency=4")
    before = set(cluster_processes())
    with Cluster(cfg) as c:
        ranks = descendants(c.workers[0].popen.pid)
        results, records = bench(c, cfg, WORKLOAD.build(cfg.workload.name, cfg.workload, 0).sessions())
        info = c.worker_infos()[c.worker_urls[0]]
    assert results["requests_completed"] == 4 and results["requests_failed"] == 0
    assert info["parallel"] == "dp_attn" and info["parallel_size"] == 2
    assert len(ranks) >= 2
    assert set(cluster_processes()) == before
    assert gone(ranks)
