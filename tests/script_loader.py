"""The experiments' scripts as modules for the tests: experiments/ is no package, each script a file to run.
Any test imports it as `script_loader`: pytest puts tests/ on sys.path when it loads tests/conftest.py."""
from __future__ import annotations

import sys
from pathlib import Path

from framework.core import paths

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, *, own_folder: bool = False):
    """experiments/<study>/<script>.py (from the checkout's root, or absolute) as the module <study>_<script>, loaded
    afresh, without running its main (framework.core.paths.load_script).
    own_folder: the script's folder first on sys.path, as when it is run, for the siblings it imports (left there:
    a caller that must not keep it restores sys.path itself, e.g. with monkeypatch)."""
    path = ROOT / path
    if own_folder:
        sys.path.insert(0, str(path.parent))
    return paths.load_script(path, fresh=True)
