"""Where the checkout is, which commit its code is (so every results file says what produced it), and its scripts as
modules."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"


def git_sha() -> str:
    """The checkout's commit, "+dirty" when its code or configs differ from it (the figures are not that commit's):
    a tracked .py or .yaml file edited, or one not yet committed (a new plugin: `git add` it or not, it ran);
    edited docs and results files do not count, nor ignored files (outputs/)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=REPO_ROOT).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        changed = sha and git("status", "--porcelain", "--untracked-files=all", "--", ":/*.py", ":/*.yaml")
        return sha + ("+dirty" if changed else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_script(path: str | Path, *, fresh: bool = False):
    """A script of the checkout (a path from its root, or absolute: experiments/ is no package, each script a file to
    run) as the module <folder>_<stem>, without running its main; once per process unless ``fresh``. It is in
    sys.modules before it runs (a dataclass in it looks its module up there). A bare `import run` would take whichever
    folder's run.py the process imported first."""
    path = REPO_ROOT / path
    name = f"{path.parent.name}_{path.stem}"
    if not fresh and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    before = sys.modules.get(name)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:            # no half-run module for the next caller to find: the one before, if any
        if before is None:
            del sys.modules[name]
        else:
            sys.modules[name] = before
        raise
    return module
