"""mode=sim: simulate the run's cluster (cluster.instances instances of the run's parallelism, MoE backend, engine
and memory budget, behind the run's router policy) on the run's workload, with the cost model `sim.cost`; report the
keys a cluster bench reports (framework/report/metrics.py, framework/cluster/figures.py, framework/engine/stats.py),
plus what was simulated and how fast."""
from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import asdict

from omegaconf import OmegaConf

from framework.engine.stats import engine_figures
from framework.core.errors import UserError
from framework.report.metrics import summarize
from framework.core.registry import COST, ROUTING, WORKLOAD
from framework.cluster.cluster import instance_roles, kv_block_size
from framework.engine.config import Role
from framework.sim.pd import PD, instance_config
from framework.cluster.figures import cluster_figures
from framework.core.errors import ClusterError
from framework.serving.router.config import split_router_config
from framework.sim.cluster import Simulation
from framework.contracts.cost import CostModel, InstanceShape
from framework.sim.instance import SimInstance
from framework.sim.router import SimRouter
from framework.routing.dp_aware import DPAware
from framework.runs.checks import check_instance
from framework.runs.finish import finish
from framework.runs.progress import phase


def cost_instance(cfg) -> InstanceShape:
    """What the cost model prices: the run's model shapes on its hardware, split as its plugins split it."""
    return InstanceShape(cfg.model, cfg.hardware, cfg.parallel.name, cfg.parallel.size, cfg.moe.name,
                    parallel_cfg=cfg.parallel, moe_cfg=cfg.moe)


def cost_model(cfg) -> CostModel:
    """The run's cost model (`sim.cost`), built for its instances."""
    return COST.build(cfg.sim.cost.name, cfg.sim.cost, cost_instance(cfg))


def build(cfg, sessions, progress: bool = False, cost: CostModel | None = None,
          role_cfgs: dict | None = None) -> Simulation:
    """The simulation of `cfg`'s cluster on `sessions`, priced by `cost` (default: the run's; ValueError for what
    cannot be simulated). `role_cfgs` (Role -> a config composed apart, e.g. on other hardware with its own memory):
    that role's instances run it instead of `cfg`, each priced by a cost model built for it (Splitwise-HA's H100
    prompt machines beside A100 token machines); the model, the node size and the KV links stay the run's."""
    if cfg.cluster.workers or cfg.cluster.url:
        raise ValueError("mode=sim simulates local instances (cluster.instances); drop cluster.workers/cluster.url")
    if cfg.cluster.instances < 1:
        raise ValueError(f"cluster.instances must be >= 1, got {cfg.cluster.instances}")
    if cfg.sim.host_cores < 0 or cfg.sim.host_background < 0 or cfg.sim.host_side_procs < 0:
        raise ValueError(f"sim.host_cores, sim.host_background and sim.host_side_procs must be >= 0, got "
                         f"{cfg.sim.host_cores}, {cfg.sim.host_background} and {cfg.sim.host_side_procs}")
    cost = cost or cost_model(cfg)
    http = cfg.cluster.http                 # cluster.http=false: one instance, the in-process driver (no router, HTTP)
    names = [f"sim://instance-{i}" for i in range(cfg.cluster.instances if http else 1)]
    try:                                    # cluster.roles: prefill/decode disaggregation (framework/sim/pd.py)
        roles = instance_roles(cfg.cluster, len(names), cfg.engine.role) if http else [Role.mixed]
    except ClusterError as e:
        raise ValueError(str(e)) from None
    role_cfgs = role_cfgs or {}
    role_costs = role_cost_models(cfg, cost, role_cfgs, set(roles))
    cfgs = {n: role_cfgs.get(r, cfg) if r is Role.mixed else instance_config(role_cfgs.get(r, cfg), r)
            for n, r in zip(names, roles)}
    instances = {n: SimInstance(n, cfgs[n], role_costs.get(r, cost), cfg.seed, http=http) for n, r in zip(names, roles)}
    policy_cfg, service = split_router_config(cfg.router)
    try:
        block_size = kv_block_size(cfg.cluster, policy_cfg)
    except ClusterError as e:
        raise ValueError(str(e)) from None
    policy = ROUTING.get(cfg.router.name)(policy_cfg, cfg.seed)
    if service.dp_aware:                    # router.dp_aware: the policy picks each instance's DP group too
        policy = DPAware(policy, lambda name: instances[name].dispatcher.size)
    router = SimRouter(policy, names, service.maintain_interval_secs, block_size, service.load_poll_interval_s)
    for name, inst in instances.items():
        router.watch(name, [g.cache for g in inst.groups])
    s, tokenizer = cfg.sim, instances[names[0]].tokenizer
    for key in ("outside_busy_s", "outside_cv"):
        if getattr(s, key) and not http:
            raise ValueError(f"sim.{key}={getattr(s, key)}: the time outside the engines is a client's and router's "
                             f"over HTTP; cluster.http=false (the in-process driver) has none")
    sim = Simulation(instances, router, sessions, cfg.workload, tokenizer,
                     network_s=s.network_latency_s if http else 0.0, router_s=s.router_overhead_s if http else 0.0,
                     fast_forward=s.fast_forward, host_cores=s.host_cores, side_procs=s.host_side_procs if http else 0,
                     background=s.host_background, itl=s.itl, progress=progress, host_sharing=s.host_sharing,
                     host_contention=s.host_contention, host_contention_extend=s.host_contention_extend,
                     host_contention_busy=s.host_contention_busy, host_steal=s.host_steal,
                     batch_arrivals=s.batch_arrivals, outside_busy_s=s.outside_busy_s, outside_cv=s.outside_cv,
                     outside_seed=s.outside_seed)
    if Role.prefill in roles:
        sim.pd = PD(sim, dict(zip(names, roles)), cfgs, cost, cfg.router)
    return sim


def role_cost_models(cfg, cost: CostModel, role_cfgs: dict, roles: set) -> dict:
    """A cost model for each role that has a config of its own (build's `role_cfgs`), after checking that what the
    simulation keeps one of (the model, placement's node size, the KV links framework/sim/pd.py prices transfers on)
    is the run's."""
    if set(role_cfgs) - roles:
        raise ValueError(f"role_cfgs names roles no instance has: {sorted(r.value for r in set(role_cfgs) - roles)} "
                         f"(the cluster's: {sorted(r.value for r in roles)})")
    out = {}
    for role, c in role_cfgs.items():
        if c.model != cfg.model or c.hardware.gpus_per_node != cfg.hardware.gpus_per_node:
            raise ValueError(f"the {role.value} instances' own config must keep the run's model and node size "
                             f"(hardware.gpus_per_node)")
        out[role] = cost_model(c)
        if any(out[role].kv_link(intra) != cost.kv_link(intra) for intra in (True, False)):
            raise ValueError(f"the {role.value} instances' hardware={c.hardware.name} prices KV links unlike the "
                             f"run's hardware={cfg.hardware.name}: transfers between them are not modelled")
    return out


def simulate(cfg, progress: bool = False) -> tuple[dict, list]:
    """(results, records) of simulating `cfg`."""
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    cost = cost_model(cfg)
    sim = build(cfg, sessions, progress, cost)
    phase(f"simulating {sum(len(s.turns) for s in sessions)} requests on {len(sim.instances)} instances")
    t0, cpu0 = time.perf_counter(), time.process_time()
    records, duration = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results = summarize(records, duration, cfg.workload.slo)
    stats = {name: inst.stats() for name, inst in sim.instances.items()}
    figures = cluster_figures(records, list(sim.instances), sim.router.stats(), stats)
    for key in ("router_decision_p50_us", "router_decision_p99_us"):
        del figures[key]                            # the router's own speed is not simulated
    results.update(figures)
    if sim.pd is not None:
        results.update(sim.pd.describe())
    results.update(engine_figures([{}] * len(stats), list(stats.values()), start=0.0))   # t=0: the run began
    results.update({**cost.describe(), "sim_model": asdict(cfg.model), "sim_instances": len(stats),
                    "sim_wall_s": wall, "sim_requests_per_wall_s": len(records) / wall if wall > 0 else float("nan"),
                    "sim_cpu_s": cpu})                # below sim_wall_s when other work shares the machine
    if cfg.sim.host_cores and cfg.cluster.http:         # sim.outside_busy_s's scale, mean over the sends
        results["sim_send_busy_share"] = sim.send_busy_share()
    if cfg.cluster.http:                                # what sim.outside_cv's draws multiply (experiments/sim_fidelity)
        results["sim_outside_wait_rms_ms"] = sim.outside_wait_rms() * 1e3
    return results, records


def what_it_models(cfg) -> str:
    """One sentence on what the simulation stands for: whose step times, and on which hosts, so that its figures are
    not read as this machine's (a real run here shares this host's CPU cores, which sim.host_cores models)."""
    cost = COST.get(cfg.sim.cost.name)
    if cost.reads_hardware:
        steps = f"step times of {cfg.hardware.name} GPUs (hardware={cfg.hardware.name}, sim.cost={cfg.sim.cost.name})"
    else:
        steps = f"the step times sim.cost={cfg.sim.cost.name} measured, one instance alone"
    cores = os.cpu_count() or 1
    if cfg.sim.host_cores:
        host = (f"every rank{', the router and the load client' if cfg.cluster.http else ''} sharing "
                f"{cfg.sim.host_cores} CPU cores (sim.host_cores={cfg.sim.host_cores}, sim.host_background="
                f"{cfg.sim.host_background:g})")
    elif cost.reads_hardware:
        gpus = f"{cfg.parallel.size} GPU{'s' if cfg.parallel.size > 1 else ''}"
        host = f"each instance on {gpus} of its own, not this host"
    else:
        who = "ranks, router and load client" if cfg.cluster.http else "ranks and this process"
        host = (f"each instance on CPU cores of its own: not this host, where a real run's {who} share {cores} "
                f"core{'s' if cores > 1 else ''} (sim.host_cores={cores} models that)")
    return f"simulated: {steps}, {host}"


def run(cfg, out_dir: str, resolved: dict) -> float:
    """mode=sim: simulate, report like a bench. Returns output tok/s (simulated)."""
    check_instance(cfg)
    models = what_it_models(cfg)
    try:
        results, records = simulate(cfg, progress=sys.stderr.isatty())
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    results["sim_models"] = models
    published = published_figures(cfg, results)
    if published:
        results["published"] = published
    figure = finish(cfg, out_dir, resolved,
                    f"sim ({cfg.sim.cost.name}): {cfg.workload.name}, router={cfg.router.name}, "
                    f"{cfg.cluster.instances} instances, parallel={cfg.parallel.name}x{cfg.parallel.size}, "
                    f"moe={cfg.moe.name}, model={cfg.model.name}", results, records)
    print(models)
    if published:
        print(published_table(published))
    return figure


def published_figures(cfg, results: dict) -> dict | None:
    """The experiment's published figures for this run's case (`sim.published`: source, case = a config path,
    figures = {case value: {key: value}}), each beside the simulated one; None when it gives none for this case."""
    pub = cfg.sim.published
    if not pub:
        return None
    pub = OmegaConf.to_container(pub) if OmegaConf.is_config(pub) else dict(pub)
    case = None
    if pub.get("case"):
        try:
            case = functools.reduce(getattr, pub["case"].split("."), cfg)
        except AttributeError:
            raise UserError(f"sim.published.case={pub['case']!r} names no config value (e.g. router.name)") from None
    figures = pub["figures"].get(case) if case is not None else pub["figures"]
    if not figures:
        return None
    rows = {k: {"published": v, "simulated": results.get(k),
                "ratio": results[k] / v if isinstance(results.get(k), (int, float)) and v else None}
            for k, v in figures.items()}
    return {"source": pub.get("source", ""), "case": f"{pub.get('case')}={case}" if case is not None else "",
            "figures": rows}


def _figure(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"


def published_table(published: dict) -> str:
    lines = [f"published: {published['source']}" + (f" ({published['case']})" if published["case"] else ""),
             f"  {'figure':<24} {'published':>12} {'simulated':>12} {'sim/pub':>8}"]
    for k, row in published["figures"].items():
        sim, ratio = row["simulated"], row["ratio"]
        lines.append(f"  {k:<24} {_figure(row['published']):>12} {'' if sim is None else _figure(sim):>12} "
                     f"{'' if ratio is None else f'{ratio:.2f}x':>8}")
    return "\n".join(lines)
