"""Compose run configs the way run.py does, for the tests of this directory."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from framework.config import register_configs, to_objects

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()


def make_cfg(*overrides: str):
    """The RootConfig of `python run.py <overrides>` (logger off)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_objects(compose("config", overrides=["logger.mode=disabled", *overrides]))


def assert_no_rank_left(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank process {pid} outlived its instance")
