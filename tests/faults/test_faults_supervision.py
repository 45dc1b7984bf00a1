"""The supervised cluster: a worker or router that dies is restarted (serve mode keeps serving), a process that keeps
dying is given up on, only a signal stops the cluster and nothing outlives it; external workers may come up late."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cluster_helpers import ROOT, cluster_cfg, compose, descendants, free_port_block, group_alive
from fault_helpers import BackgroundApp, listed, wait_for
from framework.cluster.cluster import Cluster, ClusterError, http_json
from serving_helpers import free_port, status_app

SERVE = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from cluster_helpers import compose
from framework.runs.serve import serve_cluster
serve_cluster(compose("cluster.instances=1", "router.port={port}", "engine.kv_budget_mb=1",
                      "cluster.restart_backoff_s=0.1", "router.health_check_interval_secs=0.5"))
"""


def roles(pid: int) -> dict[str, int]:
    """The serve process's children by role (worker, router), from /proc."""
    found = {}
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"framework.cluster.proc" in args and os.getpgid(child) == child:
            found[args[args.index(b"framework.cluster.proc") + 1].decode()] = child
    return found


@pytest.mark.long
def test_serve_restarts_what_dies_and_a_killed_parent_leaves_nothing():
    port = free_port_block(2)
    router = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", SERVE.format(root=str(ROOT), tests=str(ROOT / "tests" / "cluster"),
                                                                  port=port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("router:"):
                break
        first = roles(proc.pid)
        groups = set(first.values())
        os.killpg(first["worker"], signal.SIGKILL)
        wait_for(lambda: roles(proc.pid).get("worker", first["worker"]) != first["worker"] and
                 http_json("GET", router + "/health")["healthy_workers"] == 1, 60, "the worker to be restarted")
        os.killpg(first["router"], signal.SIGKILL)

        def router_back():
            try:
                return http_json("GET", router + "/health", timeout=1)["healthy_workers"] == 1
            except OSError:
                return False
        wait_for(router_back, 60, "the router to be restarted")
        assert proc.poll() is None  # serve mode went on throughout
        out = http_json("POST", router + "/generate", data=b'{"text": "still here", "sampling_params": '
                                                             b'{"max_new_tokens": 2}}', timeout=30)
        assert out["meta_info"]["completion_tokens"] == 2
        now = roles(proc.pid)
        assert set(now) == {"worker", "router"} and not set(now.values()) & groups
        groups |= set(now.values())
    finally:
        proc.kill()  # the parent dies outright: its restarted children too (they were the supervisor thread's)
        proc.wait(30)
    deadline = time.monotonic() + 20
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(group_alive(g) for g in groups)


@pytest.mark.long
def test_a_worker_that_keeps_dying_is_given_up_on_and_the_last_one_ends_the_cluster():
    cfg = cluster_cfg(2, "cluster.max_restarts=0", "router.health_check_interval_secs=0.5")
    with Cluster(cfg) as c:
        c.kill_worker(0)
        wait_for(lambda: c.restarts()["workers_given_up"] == 1, 10, "worker 0 to be given up on")
        assert c.supervisor.fatal is None and listed(c.router_url)["urls"] == [c.worker_urls[1]]
        out = http_json("POST", c.router_url + "/generate", data=b'{"text": "x", "sampling_params": '
                                                                   b'{"max_new_tokens": 1}}', timeout=30)
        assert out["meta_info"]["completion_tokens"] == 1
        c.kill_worker(1)
        wait_for(lambda: c.supervisor.fatal is not None, 10, "the cluster to have nothing left")
        assert "every worker" in c.supervisor.fatal and "exited with status -9" in c.supervisor.fatal
        assert c.restarts() == {"worker_restarts": 0, "router_restarts": 0, "workers_given_up": 2}


@pytest.mark.long
def test_external_workers_that_come_up_late_join_when_they_do():
    up = BackgroundApp(status_app(200, body={"text": "ok"}))
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    cfg = compose(f"router.port={free_port_block(1)}", f"cluster.workers=[{up.url},{late_url}]",
                  "router.health_check_interval_secs=0.2", "logger.mode=disabled")
    try:
        with Cluster(cfg) as c:  # one is up: the cluster starts, routing to it
            assert http_json("GET", c.router_url + "/health")["healthy_workers"] == 1
            late = BackgroundApp(status_app(200, body={"text": "late"}), port=late_port)
            wait_for(lambda: http_json("GET", c.router_url + "/health")["healthy_workers"] == 2, 10,
                     "the late worker to join")
            late.close()
    finally:
        up.close()
    cfg = compose(f"router.port={free_port_block(1)}", f"cluster.workers=[{late_url}]",
                  "cluster.startup_timeout_s=5", "logger.mode=disabled")
    with pytest.raises(ClusterError, match="does not route to any worker"):
        with Cluster(cfg):
            pass

