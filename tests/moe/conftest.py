"""The repository root goes first on sys.path: pytest's rootdir conftest puts tests/ there, and tests/kernels (no
__init__.py) would then shadow the `kernels` package as a namespace package, hiding kernels.select_fused_moe (here
and in spawned ranks, which inherit sys.path)."""
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path[:1]:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def size2_results():
    """One size-2 gloo launch (spawning costs seconds) whose per-rank results several test files check."""
    from framework.dist import launch
    from moe_rank_fns import run_all_cases
    return launch(run_all_cases, 2, backend="gloo", timeout_s=30)
