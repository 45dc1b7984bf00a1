"""Fixtures shared by tests/sim: experiments/pd_splitwise's scripts, loaded as modules (experiments/ is no package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPLITWISE = Path(__file__).resolve().parents[2] / "experiments/pd_splitwise"


def load_splitwise(name: str):
    """experiments/pd_splitwise/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"pd_splitwise_{name}", SPLITWISE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def predict():
    """experiments/pd_splitwise/predict.py."""
    return load_splitwise("predict")


@pytest.fixture(scope="module")
def splitwise_compare():
    """experiments/pd_splitwise/compare.py."""
    return load_splitwise("compare")
