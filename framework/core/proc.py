"""What /proc says of a process: its CPU time so far, all its threads (a child's or a peer's, which
``time.process_time`` cannot read)."""
from __future__ import annotations

import os


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far (/proc/<pid>/stat; the kernel's clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick
