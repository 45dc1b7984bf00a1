"""mode=serve: start the cluster and keep it up until Ctrl-C (or SIGTERM). A worker or the router that dies is
restarted (cluster.restart_workers); the cluster ends by itself only when nothing is left to serve with."""
from __future__ import annotations

import signal
import threading
import time

from framework.cluster.cluster import Cluster
from framework.core.errors import ClusterError
from framework.runs.checks import check_instance
from framework.runs.progress import phase


def run(cfg, out_dir: str, resolved: dict) -> float:
    if not cfg.cluster.workers:
        check_instance(cfg)
    return serve_cluster(cfg)


def serve_cluster(cfg) -> float:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)   # also when started in the background (`&`)
    phase("starting the workers and the router")
    with Cluster(cfg) as cluster:
        try:                                    # from here a Ctrl-C is a clean stop, also while the address prints
            phase(None)                         # up: serving until stopped, nothing to report
            print(f"router: {cluster.router_url}  (router={cfg.router.name}; workers: "
                  f"{', '.join(cluster.worker_urls)})\ntry: curl {cluster.router_url}/generate -d "
                  f"'{{\"text\": \"Hello\"}}'   Ctrl-C stops the cluster", flush=True)
            while not (fatal := _fatal(cluster)):
                time.sleep(0.2)
        except KeyboardInterrupt:
            print("stopping the cluster", flush=True)
            return 0.0
    raise ClusterError(f"{fatal} (its stderr is above); the cluster was stopped")


def _fatal(cluster: Cluster) -> str | None:
    """Why the cluster cannot serve any more, or None. Unsupervised, any child that exited is fatal."""
    if cluster.supervisor is not None:
        return cluster.supervisor.fatal
    children = cluster.workers + ([cluster.router] if cluster.router else [])
    dead = [f"{c.name} exited with status {c.popen.returncode}" for c in children if c.popen.poll() is not None]
    return "; ".join(dead) or None
