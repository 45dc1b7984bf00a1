"""What `run.py` calls once Hydra has composed the config: build the run, dispatch on `mode`, report."""
from __future__ import annotations

import logging
import random
import sys

import torch

from framework.config import Mode, RootConfig
from framework.dist.group import Group
from framework.registry import PARALLELISM, WORKLOAD

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
    if cfg.mode in (Mode.serve, Mode.sim):
        raise UserError(f"mode={cfg.mode.value} is not available yet in this version; "
                        f"available: bench, verify")
    if cfg.mode is Mode.verify:
        return _verify(cfg, out_dir, resolved)
    return _bench(cfg, out_dir, resolved)


def _single_rank_par(cfg: RootConfig):
    if cfg.parallel.size != 1:
        raise UserError(f"parallel.size={cfg.parallel.size}: this version runs one rank; use parallel.size=1")
    try:
        return PARALLELISM.build(cfg.parallel.name, cfg.parallel, Group())
    except KeyError as e:
        raise UserError(str(e)) from None


def _bench(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    from framework.engine.engine import Engine
    from framework.metrics import report, summarize
    from framework.workload.inprocess import play
    engine = Engine(cfg.model, cfg.engine, _single_rank_par(cfg), cfg.moe, cfg.seed)
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    records, duration = play(engine, sessions, cfg.workload, progress=sys.stderr.isatty())
    results = summarize(records, duration)
    timing = engine.timing
    results.update({
        "kv_bytes_per_token_per_rank": engine.kv_bytes_per_token,
        "kv_capacity_tokens_per_rank": engine.capacity,
        "max_running_requests": engine.scheduler.stats["max_running_requests"],
        "retractions": engine.scheduler.stats["retractions"],
        "steps": timing["steps"],
        "scheduler_overhead_frac": timing["schedule_s"] / max(timing["schedule_s"] + timing["forward_s"], 1e-9),
    })
    report(results, out_dir, resolved, cfg.logger, f"bench: {cfg.workload.name}, parallel={cfg.parallel.name}, "
                                                      f"moe={cfg.moe.name}")
    if results["requests_failed"]:
        raise UserError(f"{results['requests_failed']} request(s) failed; first error: "
                        f"{next(r.error for r in records if not r.ok)}")
    return results["output_throughput_tok_s"]


def _verify(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    from framework.metrics import report
    from framework.verify import verify_single
    cases = verify_single(cfg, _single_rank_par(cfg), Group())
    worst = max(c["max_abs_err"] for c in cases.values())
    results = {"verify_max_abs_err": worst, "verify_atol": cfg.verify.atol, "verify_passed": worst <= cfg.verify.atol}
    results.update({f"{name}_max_abs_err": c["max_abs_err"] for name, c in cases.items()})
    results.update({f"{name}_cached_tokens": c["cached_tokens"] for name, c in cases.items()})
    results["tight_kv_retract_retractions"] = cases["tight_kv_retract"]["retractions"]
    report(results, out_dir, resolved, cfg.logger, f"verify: parallel={cfg.parallel.name} moe={cfg.moe.name}")
    if worst > cfg.verify.atol:
        raise UserError(f"verify failed: max abs logit error {worst:.3g} > verify.atol {cfg.verify.atol:g}")
    print(f"verify passed: max abs logit error {worst:.3g} <= verify.atol {cfg.verify.atol:g}")
    return worst
