"""Compose run configs the way run.py does, for the tests of this directory."""
from __future__ import annotations

import multiprocessing
import os
from framework.config import compose


def make_cfg(*overrides: str):
    """The RootConfig of `python run.py <overrides>` (logger off)."""
    return compose(["logger.mode=disabled", *overrides])


def assert_no_rank_left(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank process {pid} outlived its instance")
