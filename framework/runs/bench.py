"""mode=bench: the workload through a router and its workers over HTTP (cluster.http, the default), or straight into
one instance in this process (cluster.http=false: no router, no HTTP)."""
from __future__ import annotations

import sys

from framework.runs.checks import build_sessions, check_instance, instance_errors
from framework.runs.finish import finish
from framework.runs.progress import phase


def requests(sessions) -> int:
    """How many requests (turns) the workload's sessions hold."""
    return sum(len(s.turns) for s in sessions)


def run(cfg, out_dir: str, resolved: dict) -> float:
    if cfg.cluster.http:
        if not cfg.cluster.workers:
            check_instance(cfg)
        return run_cluster_bench(cfg, out_dir, resolved)
    return run_inprocess_bench(cfg, out_dir, resolved)


def run_cluster_bench(cfg, out_dir: str, resolved: dict) -> float:
    """Start the cluster, run the workload through the router, report, stop. Returns output tok/s."""
    from framework.cluster.cluster import Cluster
    from framework.cluster.figures import bench
    sessions = build_sessions(cfg)
    local = 0 if cfg.cluster.workers else cfg.cluster.instances
    cluster = Cluster(cfg)                      # router.port=0 (the default): its free ports, chosen here
    print(f"cluster: router {cluster.router_url}, workers {', '.join(cluster.worker_urls)}", flush=True)
    phase(f"starting {local} workers and the router" if local else "starting the router")
    with cluster:
        phase("warming up the workers")
        cluster.warm_up()
        phase(f"playing {requests(sessions)} requests through the router")
        results, records = bench(cluster, cfg, sessions, progress=sys.stderr.isatty())
        results.update(cluster.restarts())
        phase("stopping the cluster")
    phase("writing the report")
    where = f"{len(cfg.cluster.workers)} external workers" if cfg.cluster.workers else \
        f"{cfg.cluster.instances} instances, parallel={cfg.parallel.name}x{cfg.parallel.size}"
    return finish(cfg, out_dir, resolved, f"cluster bench: {cfg.workload.name}, router={cfg.router.name}, {where}",
                  results, records)


def run_inprocess_bench(cfg, out_dir: str, resolved: dict) -> float:
    """The workload straight into one instance through the in-process driver."""
    from framework.engine.stats import engine_figures
    from framework.instance.client import open_engine
    from framework.instance.handle import SyncFace
    from framework.instance.rank_loop import InstanceSpec
    from framework.load.inprocess import play
    from framework.report.metrics import summarize
    sessions = build_sessions(cfg)
    check_instance(cfg)
    phase(f"starting the {cfg.parallel.size}-rank instance")
    with instance_errors(f"the {cfg.parallel.size}-rank instance"):
        handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
        if handle is None:                      # torchrun, rank > 0: rank 0 reports
            return 0.0
        try:
            before = handle.stats()
            phase(f"playing {requests(sessions)} requests into the instance")
            records, duration = play(SyncFace(handle), sessions, cfg.workload, progress=sys.stderr.isatty())
            after = handle.close()
        finally:
            handle.terminate()
    results = {**summarize(records, duration, cfg.workload.slo), **engine_figures([before], [after])}
    return finish(cfg, out_dir, resolved, f"bench: {cfg.workload.name}, parallel={cfg.parallel.name} "
                                          f"x{cfg.parallel.size}, moe={cfg.moe.name}", results, records)
