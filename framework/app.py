"""What `run.py` calls once Hydra has composed the config: build the run, dispatch on `mode`, report."""
from __future__ import annotations

import logging
import random
import sys
from contextlib import contextmanager

import torch

from framework.config import Mode, RootConfig
from framework.dist.group import Group
from framework.moe_stats import combine_rank_counts, expert_load_stats, load_stats
from framework.registry import MOE, PARALLELISM, WORKLOAD
from framework.engine.dp_controller import POLICIES

log = logging.getLogger("servelab")


class UserError(Exception):
    """A problem with what the user asked for: printed as one sentence, exit status 2."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """Returns the headline metric (output tok/s in bench mode) so sweepers can optimise it."""
    seed_everything(cfg.seed)
    try:
        cfg.model.validate()
        cfg.engine.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.mode is Mode.sim:
        raise UserError("mode=sim is not available yet in this version; available: bench, verify, serve")
    if cfg.mode is Mode.verify:
        return _verify(cfg, out_dir, resolved)
    if cfg.cluster.url:                 # client-only: drive a server started elsewhere (workload/client_bench.py)
        if cfg.mode is not Mode.bench:
            raise UserError(f"cluster.url drives a server started elsewhere (mode=bench); mode={cfg.mode.value} "
                            f"starts one: drop cluster.url")
        from framework.workload.client_bench import run_url_bench
        return run_url_bench(cfg, out_dir, resolved)
    if cfg.mode is Mode.serve or cfg.cluster.http:
        return _cluster(cfg, out_dir, resolved)
    return _bench(cfg, out_dir, resolved)


def _cluster(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """Router + instances over HTTP: bench runs the workload through it; serve keeps it up until Ctrl-C."""
    from framework.serving.cluster import ClusterError, run_cluster_bench, serve_cluster
    if not cfg.cluster.workers:
        _check_instance(cfg)
    try:
        return serve_cluster(cfg) if cfg.mode is Mode.serve else run_cluster_bench(cfg, out_dir, resolved)
    except (ClusterError, KeyError) as e:
        raise UserError(str(e)) from None


def _plugin(cfg: RootConfig):
    try:
        return PARALLELISM.get(cfg.parallel.name)
    except KeyError as e:
        raise UserError(str(e)) from None


def _single_rank_par(cfg: RootConfig):
    return _plugin(cfg)(cfg.parallel, Group())


def _check_instance(cfg: RootConfig) -> None:
    """Refuse a multi-rank instance the model's shapes cannot be split over, before any rank starts."""
    size = cfg.parallel.size
    if size < 1:
        raise UserError(f"parallel.size must be >= 1, got {size}")
    try:
        moe_partial = MOE.get(cfg.moe.name).layout(cfg.moe, size)[1]
    except (KeyError, ValueError) as e:
        raise UserError(str(e)) from None
    problems = _plugin(cfg).check_fits(cfg.model, size, moe_partial)
    if cfg.parallel.dp_balance not in POLICIES:
        problems.append(f"parallel.dp_balance={cfg.parallel.dp_balance!r} is not one of {', '.join(POLICIES)}")
    if problems:
        raise UserError(f"parallel={cfg.parallel.name} parallel.size={size} does not fit: " + "; ".join(problems))


@contextmanager
def _instance_errors(what: str):
    """A port in use, a rank that fails or dies: one sentence (the ranks are stopped by then)."""
    from framework.dist import CollectiveError, PortInUse, RankFailed
    from framework.engine.instance_client import failure_message
    try:
        yield
    except (PortInUse, ValueError) as e:        # ValueError: the launcher refused the backend or size
        raise UserError(str(e)) from None
    except (RankFailed, CollectiveError) as e:  # CollectiveError: under torchrun, rank 0's own collective failed
        log.debug("%s", e)                      # the rank's traceback, for -v runs
        raise UserError(f"{what} failed: {failure_message(e)}") from None


def _bench(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    from framework.metrics import failure_summary, report
    from framework.workload.inprocess import play
    try:
        sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    if cfg.parallel.size == 1:
        results, records = _bench_one_rank(cfg, sessions, play)
    else:
        results, records = _bench_instance(cfg, sessions, play)
        if results is None:                     # torchrun, rank > 0: rank 0 reports
            return 0.0
    report(results, out_dir, resolved, cfg.logger, f"bench: {cfg.workload.name}, parallel={cfg.parallel.name} "
                                                      f"x{cfg.parallel.size}, moe={cfg.moe.name}", records)
    if failure := failure_summary(records):
        raise UserError(failure)
    return results["output_throughput_tok_s"]


def _bench_one_rank(cfg: RootConfig, sessions, play) -> tuple[dict, list]:
    from framework.engine.engine import Engine
    from framework.metrics import summarize
    engine = Engine(cfg.model, cfg.engine, _single_rank_par(cfg), cfg.moe, cfg.seed)
    records, duration = play(engine, sessions, cfg.workload, progress=sys.stderr.isatty())
    results = summarize(records, duration, cfg.workload.slo)
    timing, stats = engine.timing, engine.par.stats
    results.update({
        "kv_bytes_per_token_per_rank": engine.kv_bytes_per_token,
        "kv_capacity_tokens_per_rank": engine.capacity,
        "kv_capacity_tokens_instance": engine.capacity,
        "max_running_requests": engine.scheduler.stats["max_running_requests"],
        "retractions": engine.scheduler.stats["retractions"],
        "steps": timing["steps"], "idle_steps": stats["idle_steps"],
        "graph_eligible_steps": stats["graph_eligible_steps"],
        "graph_eligible_frac": stats["graph_eligible_steps"] / max(stats["steps"], 1),
        "scheduler_overhead_frac": timing["schedule_s"] / max(timing["schedule_s"] + timing["forward_s"], 1e-9),
    })
    results.update(expert_load_stats(engine.model))
    return results, records


def _bench_instance(cfg: RootConfig, sessions, play) -> tuple[dict, list]:
    from framework.engine.instance import InstanceSpec
    from framework.engine.instance_client import open_client
    from framework.metrics import summarize
    _check_instance(cfg)
    with _instance_errors(f"the {cfg.parallel.size}-rank instance"):
        client = open_client(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
        if client is None:
            return None, None
        try:
            records, duration = play(client, sessions, cfg.workload, progress=sys.stderr.isatty())
            ranks = client.close()
        finally:
            client.terminate()
    results = summarize(records, duration, cfg.workload.slo)
    results.update(instance_results(cfg.parallel, ranks))
    return results, records


def instance_results(par_cfg, ranks: list[dict]) -> dict:
    """The KV accounting and the DP attention protocol figures of one instance, from its ranks' statistics."""
    replicated = PARALLELISM.get(par_cfg.name).replicates_batch
    owners = ranks[:1] if replicated else ranks          # TP ranks hold copies of one state: count it once
    r0, steps = ranks[0], max(ranks[0]["steps"], 1)
    busy = sum(t["timing"]["schedule_s"] + t["timing"]["forward_s"] for t in ranks)
    return {
        "kv_bytes_per_token_per_rank": r0["kv_bytes_per_token"],
        "kv_capacity_tokens_per_rank": r0["kv_capacity_tokens"],
        "kv_capacity_tokens_instance": sum(t["kv_capacity_tokens"] for t in owners),
        "max_running_requests": r0["instance_peak_running"],
        "retractions": sum(t["retractions"] for t in owners),
        "steps": r0["steps"], "idle_steps": sum(t["idle_steps"] for t in ranks),
        "graph_eligible_steps": r0["graph_eligible_steps"], "graph_eligible_frac": r0["graph_eligible_steps"] / steps,
        "scheduler_overhead_frac": sum(t["timing"]["schedule_s"] for t in ranks) / max(busy, 1e-9),
        "requests_per_rank": [t["requests"] for t in ranks],
        **load_stats(combine_rank_counts([t["expert_counts"] for t in ranks]), len(ranks)),
    }


def _verify(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    from framework.metrics import report
    from framework.verify import verify_instance, verify_single
    if cfg.parallel.size == 1:
        cases = verify_single(cfg, _single_rank_par(cfg), Group())
    else:
        _check_instance(cfg)
        with _instance_errors(f"verify on the {cfg.parallel.size}-rank instance"):
            cases = verify_instance(cfg)
        if cases is None:                       # torchrun, rank > 0: rank 0 reports
            return 0.0
    worst = max(c["max_abs_err"] for c in cases.values())
    problems = [f"{name}: {p}" for name, c in cases.items() for p in c.get("problems", [])]
    passed = worst <= cfg.verify.atol and not problems
    results = {"verify_max_abs_err": worst, "verify_atol": cfg.verify.atol, "verify_passed": passed,
               "parallel_size": cfg.parallel.size}
    for name, c in cases.items():
        results.update({f"{name}_{k}": v for k, v in c.items() if k not in ("problems", "requests")})
    report(results, out_dir, resolved, cfg.logger, f"verify: parallel={cfg.parallel.name} x{cfg.parallel.size} "
                                                      f"moe={cfg.moe.name}")
    if worst > cfg.verify.atol:
        raise UserError(f"verify failed: max abs logit error {worst:.3g} > verify.atol {cfg.verify.atol:g}")
    if problems:
        raise UserError("verify failed: " + "; ".join(problems))
    print(f"verify passed: max abs logit error {worst:.3g} <= verify.atol {cfg.verify.atol:g}")
    return worst
