"""The fault-injection suite: the serving and cluster tests' helpers, and anyio on asyncio."""
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "serving"), str(TESTS / "cluster")]


@pytest.fixture
def anyio_backend():
    return "asyncio"
