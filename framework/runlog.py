"""What a run leaves in its folder besides its figures: what it printed (run.log, after Hydra's own log lines) and,
when it fails after its config was composed, its error (results.json's `error`, and error.txt with the traceback of
anything that is not a UserError). The child processes a cluster starts (router, workers) write to the console and,
line by line with their name in front (`[worker 0] ...`), to run.log (framework/cluster/processes.py)."""
from __future__ import annotations

import json
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path

from framework.cluster.processes import children_output_to
from framework.core.errors import UserError
from framework.core.paths import git_sha
from framework.core.records import RESULTS_FILE
from framework.runs.finish import strict_json

LOG_FILE = "run.log"          # Hydra's job log (hydra.job.name is `run`): its log records, and here the console


class _Tee:
    """A console stream that also writes to the run's log; to callers it is still the console (isatty, fileno), so
    progress bars and colours decide as before."""

    def __init__(self, console, log, lock):
        self._console, self._log, self._lock = console, log, lock

    def write(self, text: str) -> int:
        if "\r" not in text:                 # a progress bar's redraw stays on the console
            with self._lock:
                self._log.write(text)
        return self._console.write(text)

    def flush(self) -> None:
        self._console.flush()
        self._log.flush()

    def __getattr__(self, name):
        return getattr(self._console, name)


@contextmanager
def console_to_log(out_dir: str):
    """Copy what this process and the cluster's children print to stdout and stderr into `out_dir`/run.log while
    the block runs (a child's lines prefixed by its name; they come from the children's relay threads)."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def child_line(name: str, line: str) -> None:
        with lock:
            if not log.closed:
                log.write(f"[{name}] {line}")

    with open(path / LOG_FILE, "a", buffering=1) as log, children_output_to(child_line):
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log, lock), _Tee(stderr, log, lock)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = stdout, stderr


def record_error(out_dir: str, error: BaseException, config: dict) -> tuple[str, Path]:
    """Add the error to what the run wrote (its figures, if it got that far): results.json's `error`, config.json if
    missing, error.txt with the traceback when it is a bug rather than a bad setting. Returns (the error as one line,
    results.json's path)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    try:
        results = json.loads(path.read_text()) if path.is_file() else {"git_sha": git_sha()}
    except ValueError:                        # a half-written file: start again
        results = {"git_sha": git_sha()}
    user_error = isinstance(error, UserError)     # a bad setting (one sentence), not a bug (a traceback too)
    results["error"] = str(error) if user_error else f"{type(error).__name__}: {error}"
    path.write_text(strict_json(results))
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(strict_json(config))
    if not user_error:
        (out / "error.txt").write_text("".join(traceback.format_exception(error)))
    return results["error"], path
