"""Compose run configs the way run.py does (logger off)."""
from framework.config import compose


def make_cfg(*overrides: str):
    return compose(["logger.mode=disabled", *overrides])
