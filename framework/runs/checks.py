"""What every driver that starts an instance checks first, and how an instance's failure becomes one sentence."""
from __future__ import annotations

import logging
from contextlib import contextmanager

from framework.core.errors import UserError
from framework.core.registry import MOE, PARALLELISM
from framework.engine.engine import plan_memory

log = logging.getLogger("servelab")


def parallelism(cfg):
    """The run's parallelism plugin class."""
    try:
        return PARALLELISM.get(cfg.parallel.name)
    except KeyError as e:
        raise UserError(str(e)) from None


def check_instance(cfg) -> None:
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
    if problems := parallelism(cfg).check_fits(cfg.parallel, cfg.model, moe_partial):
        raise UserError(f"parallel={cfg.parallel.name} parallel.size={size} does not fit: " + "; ".join(problems))
    try:
        plan_memory(cfg.model, cfg.engine, parallelism(cfg), cfg.parallel, moe, cfg.moe)
    except ValueError as e:
        raise UserError(str(e)) from None


@contextmanager
def instance_errors(what: str):
    """A port in use, a rank that fails or dies: one sentence (the ranks are stopped by then)."""
    from framework.dist import CollectiveError, PortInUse, RankFailed
    from framework.instance.client import failure_message
    from framework.instance.handle import EngineDown
    try:
        yield
    except (PortInUse, ValueError) as e:        # ValueError: the launcher refused the backend or size
        raise UserError(str(e)) from None
    except (RankFailed, CollectiveError) as e:  # CollectiveError: under torchrun, rank 0's own collective failed
        log.debug("%s", e)                      # the rank's traceback, for -v runs
        raise UserError(f"{what} failed: {failure_message(e)}") from None
    except EngineDown as e:                     # the instance died while the workload ran
        raise UserError(f"{what} failed: {e}") from None


def build_sessions(cfg):
    """The run's workload as sessions; a bad workload setting or a missing data file is one sentence."""
    from framework.core.registry import WORKLOAD
    try:
        return WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    except (KeyError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
