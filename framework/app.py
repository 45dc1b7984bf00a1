"""What `run.py` calls once Hydra has composed the config: seed, validate, dispatch on `mode` to its driver
(framework/runs/), each of which ends in framework/runs/finish.py. Any problem with what was asked is a
framework.core.errors.UserError: one sentence, exit status 2."""
from __future__ import annotations

import random

import torch

from framework.config import Mode, RootConfig
from framework.core.errors import UserError
from framework.runs.progress import heartbeat


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def driver(cfg: RootConfig):
    """The mode's driver: a module of framework/runs/ with `run(cfg, out_dir, resolved) -> headline figure`."""
    if cfg.cluster.url:                 # client-only: drive a server started elsewhere
        if cfg.mode is not Mode.bench:
            raise UserError(f"cluster.url drives a server started elsewhere (mode=bench); mode={cfg.mode.value} "
                            f"starts one: drop cluster.url")
        from framework.runs import url
        return url
    if cfg.mode is Mode.sim:
        from framework.runs import sim
        return sim
    if cfg.mode is Mode.verify:
        from framework.runs import verify
        return verify
    if cfg.mode is Mode.serve:
        from framework.runs import serve
        return serve
    from framework.runs import bench
    return bench


def run(cfg: RootConfig, out_dir: str, resolved: dict) -> float:
    """Returns the headline metric (output tok/s in bench mode) so sweepers can optimise it."""
    seed_everything(cfg.seed)
    try:
        cfg.model.validate()
        cfg.engine.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.progress_interval_s < 0:
        raise UserError(f"progress_interval_s={cfg.progress_interval_s:g} must be >= 0 (0: no progress lines)")
    with heartbeat(cfg.progress_interval_s):   # off a terminal: a line every progress_interval_s (the phase, time)
        return driver(cfg).run(cfg, out_dir, resolved)
