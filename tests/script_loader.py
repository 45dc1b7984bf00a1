"""The experiments' scripts as modules for the tests: experiments/ is no package, each script a file to run.
Any test imports it as `script_loader`: pytest puts tests/ on sys.path when it loads tests/conftest.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, *, own_folder: bool = False):
    """experiments/<study>/<script>.py (from the checkout's root, or absolute) as the module <study>_<script>, without
    running its main. It is in sys.modules before it runs: a dataclass in it looks its module up there.
    own_folder: the script's folder first on sys.path, as when it is run, for the siblings it imports (left there:
    a caller that must not keep it restores sys.path itself, e.g. with monkeypatch)."""
    path = ROOT / path
    if own_folder:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]   # no half-run module for the next test to find
        raise
    return module
