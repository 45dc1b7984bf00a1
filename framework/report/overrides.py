"""What a run was asked for, in the words the user typed: its Hydra overrides (`.hydra/overrides.yaml` in the run's
directory, written by Hydra for single runs and for every point of a multirun). Reports label runs with them and
the W&B mirror names a run by them: `router=round_robin` reads better than the twenty router fields it changed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
# Settings that differ between runs without changing what ran (ports, where the output and the W&B mirror go).
IGNORED_PREFIXES = ("router.port", "cluster.worker_ports", "logger.", "hydra.", "hydra/")
IGNORED_KEYS = ("logger", "hydra")


def ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


def parse(items: list[str]) -> dict[str, Any]:
    """["router=<policy>", "+x.y=2", "~z"] -> {"router": "<policy>", "x.y": 2, "z": None}, ignored keys left
    out; a value reads as YAML does (2.0 a float, true a bool, [a,b] a list), as Hydra reads it."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+~")
        if ignored(key):
            continue
        try:
            out[key] = yaml.safe_load(value) if sep else None
        except yaml.YAMLError:                       # Hydra's own syntax (choice(), interval(), ...): as typed
            out[key] = value
    return out


def run_overrides(run_dir: Path) -> dict[str, Any] | None:
    """The run's overrides (ignored keys left out), or None when the run left no record of them (a run written by an
    experiment script rather than run.py)."""
    path = Path(run_dir) / OVERRIDES_FILE
    if not path.is_file():
        return None
    return parse(yaml.safe_load(path.read_text()) or [])


def show(value: Any) -> str:
    """A setting's value as the user would type it: true, 0.5, [a,b]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ",".join(show(v) for v in value) + "]"
    return json.dumps(value)


def label(settings: dict[str, Any]) -> str:
    """{"router": "<policy>", "workload.request_rate": 2.0} -> "router=<policy> workload.request_rate=2.0"."""
    return " ".join(f"{k}={show(v)}" for k, v in settings.items())
