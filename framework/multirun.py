"""Studies of many runs: Hydra multiruns and W&B sweeps.

- A run's W&B identity: runs of one multirun share a group (the multirun's directory), runs of one W&B sweep share
  the sweep's id; each run is named by its overrides (Hydra's `job.override_dirname`). `logger.group` and
  `logger.name` override both.
- A setting refused in the points (an unknown option, a key a point would ignore) stops the multirun before any point
  runs (framework/config.py: check_overrides). A point that fails while it runs writes results.json with its `error`
  (framework/runlog.py) and returns NaN (an Optuna sweeper counts the trial as failed), so the sweep goes on;
  `FailureCount`, a Hydra callback (conf/config.yaml), counts the failed points when the multirun ends and makes the
  exit status their number (at most 100).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hydra.types import RunMode
from hydra.experimental.callback import Callback

from framework.core.records import RESULTS_FILE

MAX_STATUS = 100


def in_multirun(hydra_cfg) -> bool:
    return hydra_cfg.mode is RunMode.MULTIRUN


def name_run(logger_cfg, hydra_cfg) -> None:
    """Fill in logger.group and logger.name (when not set) from the sweep or multirun this run belongs to."""
    if logger_cfg.group is None:
        if os.environ.get("WANDB_SWEEP_ID"):
            logger_cfg.group = f"sweep-{os.environ['WANDB_SWEEP_ID']}"
        elif in_multirun(hydra_cfg):
            logger_cfg.group = str(hydra_cfg.sweep.dir)
    if logger_cfg.name is None:
        logger_cfg.name = hydra_cfg.job.override_dirname or None


def sweep_outcome(sweep_dir: Path) -> tuple[int, list[str]]:
    """(runs, one line per failed run) of a multirun: a run is a directory Hydra wrote a .hydra/ into; it failed when
    its results.json holds an error or is missing."""
    runs = sorted(p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir())
    failed = []
    for run in runs:
        path = run / RESULTS_FILE
        error = json.loads(path.read_text()).get("error") if path.is_file() else f"no {RESULTS_FILE} written"
        if error:
            failed.append(f"{run}: {error}")
    return len(runs), failed


class FailureCount(Callback):
    """At the end of a multirun: say how many points failed and make that the exit status."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        total, failed = sweep_outcome(sweep_dir)
        print(f"multirun: {total - len(failed)} of {total} runs completed, {len(failed)} failed ({sweep_dir}); "
              f"python -m framework.report {sweep_dir} aggregates them", file=sys.stderr)
        for line in failed:
            print(f"  failed: {line}", file=sys.stderr)
        if failed:
            sys.exit(min(len(failed), MAX_STATUS))
