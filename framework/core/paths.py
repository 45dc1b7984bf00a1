"""Where the checkout is, and which commit its code is (so every results file says what produced it)."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"


def git_sha() -> str:
    """The checkout's commit, "+dirty" when its tracked code or configs differ from it (the figures are not that
    commit's); edited docs and results files do not count."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=REPO_ROOT).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        edited = sha and git("status", "--porcelain", "--untracked-files=no", "--", ":/*.py", ":/*.yaml")
        return sha + ("+dirty" if edited else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
