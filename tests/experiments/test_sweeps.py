"""Every point of every W&B sweep file composes through Hydra, with the overrides `wandb agent` would pass
(`${args_no_hyphens}`: `key=value` for each parameter, then the command's own arguments)."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from framework.config import CONF_DIR, register_configs, to_objects

SWEEPS = sorted((Path(__file__).resolve().parents[2] / "experiments" / "sweeps").glob("*.yaml"))


def points(spec: dict) -> list[dict]:
    """Every parameter combination a grid sweep runs; a distribution contributes its two ends."""
    choices = {}
    for key, p in spec["parameters"].items():
        if "value" in p:
            choices[key] = [p["value"]]
        elif "values" in p:
            choices[key] = p["values"]
        else:
            choices[key] = [p["min"], p["max"]]
    return [dict(zip(choices, combo)) for combo in itertools.product(*choices.values())]


def agent_overrides(spec: dict, point: dict) -> list[str]:
    cmd = spec["command"]
    i = cmd.index("${args_no_hyphens}")
    return [f"{k}={v}" for k, v in point.items()] + cmd[i + 1:]


def test_there_are_sweeps():
    assert {p.stem for p in SWEEPS} >= {"router_policies", "parallel_moe", "request_rate"}


@pytest.mark.long
@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_point_composes(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["program"] == "run.py" and "${args_no_hyphens}" in spec["command"]
    assert spec["metric"]["goal"] in ("maximize", "minimize")
    pts = points(spec)
    assert pts
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for point in pts:
            cfg = to_objects(compose("config", overrides=agent_overrides(spec, point)))
            for key, value in point.items():             # the composed config holds what the sweep asked for
                node = cfg
                for part in key.split("."):
                    node = getattr(node, part)
                node = getattr(node, "name", node)        # a group: its chosen option
                got = getattr(node, "value", node)
                assert got == value if isinstance(value, (int, float)) else str(got) == str(value), (key, value, got)
