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


def host_cpu_s() -> tuple[float, float]:
    """The host's busy CPU seconds so far, all CPUs together (less idle and iowait; steal included; guest time is in
    user's already), and of them the steal: seconds the hypervisor ran other guests on this VM's CPUs (0 where the
    kernel reports none). From /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]   # user nice system idle iowait irq softirq steal guest...
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / tick, (ticks[7] if len(ticks) > 7 else 0) / tick
