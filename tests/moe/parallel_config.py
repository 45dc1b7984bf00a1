"""Compose run configs the way run.py does (logger off)."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from framework.config import register_configs, to_objects

CONF = Path(__file__).resolve().parents[2] / "conf"


def make_cfg(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_objects(compose("config", overrides=["logger.mode=disabled", *overrides]))
