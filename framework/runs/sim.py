"""mode=sim: simulate the run's cluster (cluster.instances instances of the run's parallelism, MoE backend, engine
and memory budget, behind the run's router policy) on the run's workload, with the cost model `sim.cost`; report the
keys a cluster bench reports (framework/report/metrics.py, framework/cluster/figures.py, framework/engine/stats.py),
plus what was simulated and how fast."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict

from framework.engine.stats import engine_figures
from framework.core.errors import UserError
from framework.report.metrics import summarize
from framework.core.registry import COST, ROUTING, WORKLOAD
from framework.cluster.cluster import kv_block_size
from framework.cluster.figures import cluster_figures
from framework.core.errors import ClusterError
from framework.serving.router.config import split_router_config
from framework.sim.cluster import Simulation
from framework.contracts.cost import CostModel, InstanceShape
from framework.sim.instance import SimInstance
from framework.sim.router import SimRouter
from framework.runs.checks import check_instance
from framework.runs.finish import finish


def cost_instance(cfg) -> InstanceShape:
    """What the cost model prices: the run's model shapes on its hardware, split as its plugins split it."""
    return InstanceShape(cfg.model, cfg.hardware, cfg.parallel.name, cfg.parallel.size, cfg.moe.name,
                    parallel_cfg=cfg.parallel, moe_cfg=cfg.moe)


def cost_model(cfg) -> CostModel:
    """The run's cost model (`sim.cost`), built for its instances."""
    return COST.build(cfg.sim.cost.name, cfg.sim.cost, cost_instance(cfg))


def build(cfg, sessions, progress: bool = False, cost: CostModel | None = None) -> Simulation:
    """The simulation of `cfg`'s cluster on `sessions`, priced by `cost` (default: the run's; ValueError for what
    cannot be simulated)."""
    if cfg.cluster.workers or cfg.cluster.url:
        raise ValueError("mode=sim simulates local instances (cluster.instances); drop cluster.workers/cluster.url")
    if cfg.cluster.instances < 1:
        raise ValueError(f"cluster.instances must be >= 1, got {cfg.cluster.instances}")
    if cfg.sim.host_cores < 0 or cfg.sim.host_background < 0:
        raise ValueError(f"sim.host_cores and sim.host_background must be >= 0, got {cfg.sim.host_cores} and "
                         f"{cfg.sim.host_background}")
    cost = cost or cost_model(cfg)
    http = cfg.cluster.http                 # cluster.http=false: one instance, the in-process driver (no router, HTTP)
    names = [f"sim://instance-{i}" for i in range(cfg.cluster.instances if http else 1)]
    instances = {n: SimInstance(n, cfg, cost, cfg.seed) for n in names}
    policy_cfg, service = split_router_config(cfg.router)
    try:
        block_size = kv_block_size(cfg.cluster, policy_cfg)
    except ClusterError as e:
        raise ValueError(str(e)) from None
    router = SimRouter(ROUTING.get(cfg.router.name)(policy_cfg, cfg.seed), names, service.maintain_interval_secs,
                       block_size, service.load_poll_interval_s)
    for name, inst in instances.items():
        router.watch(name, [g.cache for g in inst.groups])
    s, tokenizer = cfg.sim, instances[names[0]].tokenizer
    return Simulation(instances, router, sessions, cfg.workload, tokenizer,
                      network_s=s.network_latency_s if http else 0.0, router_s=s.router_overhead_s if http else 0.0,
                      fast_forward=s.fast_forward, host_cores=s.host_cores, side_procs=2 if http else 0,
                      background=s.host_background, itl=s.itl, progress=progress)


def simulate(cfg, progress: bool = False) -> tuple[dict, list]:
    """(results, records) of simulating `cfg`."""
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    cost = cost_model(cfg)
    sim = build(cfg, sessions, progress, cost)
    t0, cpu0 = time.perf_counter(), time.process_time()
    records, duration = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results = summarize(records, duration, cfg.workload.slo)
    stats = {name: inst.stats() for name, inst in sim.instances.items()}
    figures = cluster_figures(records, list(sim.instances), sim.router.stats(), stats)
    for key in ("router_decision_p50_us", "router_decision_p99_us"):
        del figures[key]                            # the router's own speed is not simulated
    results.update(figures)
    results.update(engine_figures([{}] * len(stats), list(stats.values())))
    results.update({**cost.describe(), "sim_model": asdict(cfg.model), "sim_instances": len(stats),
                    "sim_wall_s": wall, "sim_requests_per_wall_s": len(records) / wall if wall > 0 else float("nan"),
                    "sim_cpu_s": cpu})                # below sim_wall_s when other work shares the machine
    return results, records


def run(cfg, out_dir: str, resolved: dict) -> float:
    """mode=sim: simulate, report like a bench. Returns output tok/s (simulated)."""
    check_instance(cfg)
    try:
        results, records = simulate(cfg, progress=sys.stderr.isatty())
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    return finish(cfg, out_dir, resolved,
                  f"sim ({cfg.sim.cost.name}): {cfg.workload.name}, router={cfg.router.name}, {cfg.cluster.instances} "
                  f"instances, parallel={cfg.parallel.name}x{cfg.parallel.size}, moe={cfg.moe.name}, "
                  f"model={cfg.model.name}", results, records)
