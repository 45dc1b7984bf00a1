"""framework/core/proc.py: a process's CPU time from /proc, checked against what the process itself counts, and a
busy child's against the time it was busy."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from framework.core.proc import cpu_times, host_cpu_s


def test_own_cpu_times_agree_with_the_process_own_count():
    end = time.process_time() + 0.3
    while time.process_time() < end:   # some CPU of our own, so the two clocks have something to count
        pass
    user, system = cpu_times(os.getpid())
    t = os.times()
    assert abs((user + system) - (t.user + t.system)) < 0.05, ((user, system), t)


def test_a_busy_child_is_charged_its_busy_seconds():
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while sum(cpu_times(child.pid)) < 0.6 and time.monotonic() < deadline:  # busy, then waits on its input
            time.sleep(0.05)
        time.sleep(0.2)
        spent = sum(cpu_times(child.pid))
        assert 0.6 <= spent < 0.6 + 1.0, spent   # its loop, plus the interpreter's start (well under a second here)
    finally:
        child.communicate(b"\n", timeout=10)


def test_steal_is_a_count_that_only_grows():
    (busy_a, a), (busy_b, b) = host_cpu_s(), host_cpu_s()
    assert 0 <= a <= b and a <= busy_a <= busy_b
