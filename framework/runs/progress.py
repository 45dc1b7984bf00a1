"""Off a terminal (a log file, nohup, a batch job) a long run says what it is doing every `progress_interval_s`
seconds, start-up included; on a terminal the progress bars do, and nothing more is printed. Drivers name their
phase (`phase("starting 2 workers and the router")`); the lines go to stderr, and so into run.log."""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

_now = {"what": None, "since": 0.0, "done": None}


def phase(what: str | None, done=None) -> None:
    """What the run does from now on (None: nothing worth a line, e.g. serving until Ctrl-C); `done`, if given, a
    callable saying how far it got (`"12 of 48 requests done"`)."""
    _now.update(what=what, since=time.monotonic(), done=done)


@contextmanager
def heartbeat(interval_s: float, stream=None):
    """While the block runs, print `progress: ...` every interval_s seconds unless `stream` (default stderr) is a
    terminal or interval_s <= 0."""
    stream = stream or sys.stderr
    phase(None)
    if interval_s <= 0 or stream.isatty() or os.environ.get("RANK", "0") != "0":    # torchrun: rank 0 speaks
        yield
        return
    start, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            what, since, done = _now["what"], _now["since"], _now["done"]
            if what is not None:
                now = time.monotonic()
                far = f", {done()}" if done is not None else ""
                print(f"progress: {what}, {now - since:.0f} s so far{far} (run: {now - start:.0f} s)", file=stream,
                      flush=True)

    thread = threading.Thread(target=beat, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        phase(None)
