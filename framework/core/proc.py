"""What /proc says of a process: its CPU time so far, all its threads (a child's or a peer's, which
``time.process_time`` cannot read); and of the host: the time the hypervisor took from its CPUs (steal)."""
from __future__ import annotations

import os


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far (/proc/<pid>/stat; the kernel's clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def steal_s() -> float:
    """Seconds the hypervisor has run other guests on this VM's CPUs so far, all CPUs together (/proc/stat's steal;
    0 where the kernel reports none)."""
    with open("/proc/stat") as f:
        ticks = f.readline().split()[1:]  # user nice system idle iowait irq softirq steal ...
    return int(ticks[7]) / os.sysconf("SC_CLK_TCK") if len(ticks) > 7 else 0.0
