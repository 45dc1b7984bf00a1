"""The W&B mirror of a run: the flattened config, every scalar of results.json (summary and one logged step), nested
figures as wandb.Table (per-worker counts, expert load, router reasons, the load timeline) and the run's plots as
wandb.Image. Runs of one multirun or sweep share `logger.group`; each is named by `logger.name` (run.py fills both
from Hydra and the sweep, see framework/multirun.py)."""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


class LogMode(enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    mode: LogMode = LogMode.offline   # W&B: online | offline (`wandb sync` uploads later) | disabled
    project: str = "servelab"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    group: Optional[str] = None       # None: the multirun's directory, or the W&B sweep's id (one group per study)
    name: Optional[str] = None        # None: the run's overrides (Hydra's job.override_dirname, else "defaults")
    plots: bool = True                # PNG plots beside results.json (and to W&B)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"router": {"name": ...}} -> {"router.name": ...}: a sweep's `router.cache_threshold` parameter then meets the
    same key, and a sweep's `router=cache_aware` (a config group) never collides with the router's fields."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def tables(results: dict) -> dict:
    import wandb
    out = {}
    for key, value in results.items():
        if key == "worker_load_timeline" and value:
            rows = [[t, w, n] for w, counts in value["in_flight"].items() for t, n in zip(value["t_s"], counts)]
            out[key] = _table(wandb, ["t_s", "worker", "in_flight"], rows)
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            columns = sorted({c for v in value.values() for c in v})
            out[key] = _table(wandb, ["key", *columns], [[k, *(v.get(c) for c in columns)] for k, v in value.items()])
        elif isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            width = max(len(v) for v in value.values())
            out[key] = _table(wandb, ["key", *map(str, range(width))],
                              [[k, *v, *[None] * (width - len(v))] for k, v in value.items()])
        elif isinstance(value, dict) and value:
            out[key] = _table(wandb, ["key", "value"], [[k, v] for k, v in value.items()])
    return out


def _table(wandb, columns: list[str], rows: list[list]):
    """A wandb.Table whose columns each hold one type: W&B refuses a column mixing numbers and strings (a model's
    shapes: ints beside a dtype name), so such a column is written as strings."""
    for i in range(len(columns)):
        kinds = {type(r[i]) for r in rows if r[i] is not None}
        if len(kinds - {int, float}) > 0 and len(kinds) > 1:
            for r in rows:
                r[i] = None if r[i] is None else str(r[i])
    return wandb.Table(columns=columns, data=rows)


def run_name(logger_cfg, out: Path) -> str:
    """`logger.name`, else the run's overrides as typed (.hydra/overrides.yaml, ports and logger settings left out),
    else "defaults": never one of W&B's random names, which say nothing about what ran."""
    if logger_cfg.name:
        return logger_cfg.name
    from framework.report.overrides import label, run_overrides
    return label(run_overrides(out) or {}) or "defaults"


def log_run(results: dict, config: dict, logger_cfg, out: Path, plots: list[Path]) -> None:
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    mode = LogMode(logger_cfg.mode).value
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, mode=mode, dir=str(out),
                     config=flatten(config), tags=list(logger_cfg.tags), group=logger_cfg.group,
                     name=run_name(logger_cfg, out), reinit="finish_previous")
    scalars = {k: v for k, v in results.items() if isinstance(v, (int, float, str, bool))}
    run.summary.update(scalars)
    run.log({**{k: v for k, v in scalars.items() if isinstance(v, (int, float))}, **tables(results),
             **{f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}})
    run.finish()
