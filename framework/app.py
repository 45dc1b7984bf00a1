"""What `run.py` calls once Hydra has composed the config: build the run, dispatch on `mode`, report."""
from __future__ import annotations

import logging
import random
import sys
from contextlib import contextmanager

import torch

from framework.config import Mode, RootConfig
from framework.dist.group import Group
from framework.engine.engine import plan_memory
from framework.core.errors import UserError
from framework.core.registry import MOE, PARALLELISM, WORKLOAD

log = logging.getLogger("servelab")


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
        return _sim(cfg, out_dir, resolved)
    if cfg.mode is Mode.verify:
        return _verify(cfg, out_dir, resolved)
    if cfg.cluster.url:                 # client-only: drive a server started elsewhere (workload/client_bench.py)
        if cfg.mode is not Mode.bench:
            raise UserError(f"cluster.url drives a server started elsewhere (mode=bench); mode={cfg.mode.value} "
                            f"starts one: drop cluster.url")
        from framework.runs.url import run_url_bench
        return run_url_bench(cfg, out_dir, resolved)
    if cfg.mode is Mode.serve or cfg.cluster.http:
        return _cluster(cfg, out_dir, resolved)
    return _bench(cfg, out_dir, resolved)


def _cluster(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """Router + instances over HTTP: bench runs the workload through it; serve keeps it up until Ctrl-C."""
    from framework.cluster.cluster import ClusterError, run_cluster_bench, serve_cluster
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


def _check_instance(cfg: RootConfig) -> None:
    """Refuse an instance the model's shapes cannot be split over, or whose memory budget leaves no KV, before any
    rank starts."""
    size = cfg.parallel.size
    if size < 1:
        raise UserError(f"parallel.size must be >= 1, got {size}")
    try:
        moe = MOE.get(cfg.moe.name)
        moe_partial = moe.layout(cfg.moe, size)[1]
    except (KeyError, ValueError) as e:
        raise UserError(str(e)) from None
    if problems := _plugin(cfg).check_fits(cfg.parallel, cfg.model, moe_partial):
        raise UserError(f"parallel={cfg.parallel.name} parallel.size={size} does not fit: " + "; ".join(problems))
    try:
        plan_memory(cfg.model, cfg.engine, _plugin(cfg), cfg.parallel, moe, cfg.moe)
    except ValueError as e:
        raise UserError(str(e)) from None


@contextmanager
def _instance_errors(what: str):
    """A port in use, a rank that fails or dies: one sentence (the ranks are stopped by then)."""
    from framework.dist import CollectiveError, PortInUse, RankFailed
    from framework.instance.handle import EngineDown
    from framework.instance.client import failure_message
    try:
        yield
    except (PortInUse, ValueError) as e:        # ValueError: the launcher refused the backend or size
        raise UserError(str(e)) from None
    except (RankFailed, CollectiveError) as e:  # CollectiveError: under torchrun, rank 0's own collective failed
        log.debug("%s", e)                      # the rank's traceback, for -v runs
        raise UserError(f"{what} failed: {failure_message(e)}") from None
    except EngineDown as e:                     # the instance died while the workload ran
        raise UserError(f"{what} failed: {e}") from None


def _bench(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """The workload straight into one instance through the in-process driver (no HTTP)."""
    from framework.instance.handle import SyncFace
    from framework.instance.rank_loop import InstanceSpec
    from framework.instance.client import open_engine
    from framework.engine.stats import engine_figures
    from framework.report.metrics import failure_summary, report, summarize
    from framework.load.inprocess import play
    try:
        sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    _check_instance(cfg)
    with _instance_errors(f"the {cfg.parallel.size}-rank instance"):
        handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
        if handle is None:                      # torchrun, rank > 0: rank 0 reports
            return 0.0
        try:
            before = handle.stats()
            records, duration = play(SyncFace(handle), sessions, cfg.workload, progress=sys.stderr.isatty())
            after = handle.close()
        finally:
            handle.terminate()
    results = {**summarize(records, duration, cfg.workload.slo), **engine_figures([before], [after])}
    report(results, out_dir, resolved, cfg.logger, f"bench: {cfg.workload.name}, parallel={cfg.parallel.name} "
                                                      f"x{cfg.parallel.size}, moe={cfg.moe.name}", records)
    if failure := failure_summary(records):
        raise UserError(failure)
    return results["output_throughput_tok_s"]


def _sim(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """The run's cluster and workload through the simulator (framework/sim/), priced by `sim.cost`."""
    from framework.runs.sim import run_sim
    _check_instance(cfg)
    try:
        return run_sim(cfg, out_dir, resolved)
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None


def _verify(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    from framework.report.metrics import report
    from framework.runs.verify import verify_instance, verify_single
    _check_instance(cfg)
    if cfg.parallel.size == 1:
        cases = verify_single(cfg, _plugin(cfg)(cfg.parallel, Group()))
    else:
        with _instance_errors(f"verify on the {cfg.parallel.size}-rank instance"):
            cases = verify_instance(cfg)
        if cases is None:                       # torchrun, rank > 0: rank 0 reports
            return 0.0
    worst = max(c["max_abs_err"] for c in cases.values())
    problems = [f"{name}: {p}" for name, c in cases.items() for p in c.get("problems", [])]
    passed = worst <= cfg.verify.atol and not problems
    results = {"verify_max_abs_err": worst, "verify_atol": cfg.verify.atol, "verify_passed": passed,
               **_plugin(cfg).describe(cfg.parallel)}
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
