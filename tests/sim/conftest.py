"""Fixtures shared by tests/sim: experiments/pd_splitwise's scripts, loaded as modules."""
from __future__ import annotations

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def predict():
    """experiments/pd_splitwise/predict.py."""
    return load_script("experiments/pd_splitwise/predict.py")


@pytest.fixture(scope="module")
def splitwise_compare():
    """experiments/pd_splitwise/compare.py."""
    return load_script("experiments/pd_splitwise/compare.py")
