"""Where the checkout is, and which commit its code is (so every results file says what produced it)."""
from __future__ import annotations

import subprocess
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
