"""Is this the host a CPU calibration was measured on, running at the speed it ran then?

A calibrated profile (data/calibration/cpu.json, experiments/calibrate) prices steps in this host's seconds, so it
describes one host on one day: this shared VM ran the same code about 3x slower on 2026-12-02 than on 2026-11-30,
under the same name and CPU model. A profile is therefore stamped with a probe: the CPU model, the core count and the
time of a fixed piece of work shaped like the engine's CPU steps (small single-thread matmuls and the Python around
them). Comparing a fresh probe with the stamp says whether simulated seconds can be compared with real ones here.

``contention`` measures what the stamp cannot: how much slower a core runs while the others are busy too (cores that
share a physical core or its caches). The probe's work pinned to each core alone, then on every core at once: on this
VM's two vCPUs (2026-12-03) 9.0 and 10.3-12.5 ms alone, 10.7-10.9 and 12.6-15.7 together, 1.2x. A single probe moves
between those alone speeds as the scheduler places it, which is most of its flicker. ``pinned`` measures the
alone speed that way, core by core, in this process: a speed to compare across minutes without the placement in it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOLERANCE = 0.25        # a probe more than 25% slower or faster than the stamp: another host, for this purpose


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _work() -> float:
    """One probe: 400 small matmul + softmax steps with a Python loop around each (a tiny engine step's shape)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(8, 64, generator=gen), torch.randn(64, 256, generator=gen)
    t0 = time.perf_counter()
    acc = 0.0
    for i in range(400):
        h = torch.softmax(a @ w, dim=-1)
        acc += sum(j * 0.5 for j in range(40))     # the scheduler's Python beside each kernel
        a = a + h[:, :64] * 1e-3
    return time.perf_counter() - t0


def probe(repeats: int = 5) -> dict:
    """This host now: its CPU model, core count and the probe's median seconds (one torch thread, as profiled)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _work()                                    # warm-up
        seconds = statistics.median(_work() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "probe_s": seconds}


def contention(seconds: float = 3.0) -> dict:
    """The host's cores alone and together: the probe's work repeated for ``seconds`` pinned to each core alone, then
    to every core at once (a process each); ``contention`` = the mean time together / the mean alone (1.0 where cores
    cannot be pinned: one core, or no sched_setaffinity)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return {"contention": 1.0, "cpus": cpus, "alone_s": [], "together_s": []}

    def start(cpu: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "framework.core.host_probe", "--cpu", str(cpu), "--seconds",
                                 str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[2])
        if proc.stdout.readline().strip() != "ready":                 # imported and warmed up
            raise RuntimeError("the host probe pinned to a core did not start")
        return proc

    def go(procs: list[subprocess.Popen]) -> list[subprocess.Popen]:
        for proc in procs:                                            # all start timing together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return procs

    def mean_s(proc: subprocess.Popen) -> float:
        out = proc.stdout.read()
        proc.wait(timeout=120 + 10 * seconds)
        if proc.returncode:
            raise RuntimeError(f"the host probe pinned to a core failed (exit {proc.returncode})")
        return float(out)

    alone = [mean_s(go([start(cpu)])[0]) for cpu in cpus]
    together = [mean_s(p) for p in go([start(cpu) for cpu in cpus])]
    return {"contention": statistics.fmean(together) / statistics.fmean(alone), "cpus": cpus, "alone_s": alone,
            "together_s": together}


def pinned(seconds: float = 0.3) -> float:
    """The host's speed without the scheduler's placement in it: the probe's work repeated for ``seconds`` with this
    thread pinned to each core in turn, the mean over the cores of each one's mean time (the thread's affinity is
    restored after; a single probe moves between the cores' speeds as it is placed)."""
    import torch
    if not hasattr(os, "sched_getaffinity"):
        return probe()["probe_s"]
    cpus = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    means = []
    try:
        for cpu in sorted(cpus):
            os.sched_setaffinity(0, {cpu})
            _work()                                                    # warm-up on this core
            means.append(_window(seconds))
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    return statistics.fmean(means)


def _pinned(cpu: int, seconds: float) -> float:
    """The probe's work pinned to ``cpu``, repeated for ``seconds`` after a warm-up: its mean time."""
    import torch
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    _work()
    print("ready", flush=True)                 # then timed once told to go: every core's window together
    sys.stdin.readline()
    return _window(seconds)


def _window(seconds: float) -> float:
    """The probe's work repeated for ``seconds`` (at least once): its mean time."""
    times, end = [], time.perf_counter() + seconds
    while not times or time.perf_counter() < end:
        times.append(_work())
    return statistics.fmean(times)


def mismatch(stamp: dict | None, now: dict) -> list[str]:
    """Why a profile stamped `stamp` does not describe this host now (empty: it does, within TOLERANCE)."""
    if not stamp:
        return ["the profile carries no host probe (measured before probes were stamped): re-measure it with "
                "experiments/calibrate/run.py to check it against this host"]
    problems = []
    if stamp.get("cpu_model") != now["cpu_model"]:
        problems.append(f"CPU model {now['cpu_model']!r}, profiled on {stamp.get('cpu_model')!r}")
    if stamp.get("cpu_count") != now["cpu_count"]:
        problems.append(f"{now['cpu_count']} cores, profiled on {stamp.get('cpu_count')}")
    key, what = ("pinned_s", "the pinned probe") if stamp.get("pinned_s") and now.get("pinned_s") else \
        ("probe_s", "the probe")       # pinned where both have it: the unpinned probe moves as it is placed
    ratio = now[key] / stamp[key]
    if abs(ratio - 1) > TOLERANCE:
        problems.append(f"{what} takes {ratio:.2f}x its time at profiling ({now[key] * 1e3:.1f} ms vs "
                        f"{stamp[key] * 1e3:.1f} ms)")
    return problems


if __name__ == "__main__":           # one pinned measurement of ``contention``
    ap = argparse.ArgumentParser(description="the probe's work pinned to one core: its mean time over --seconds")
    ap.add_argument("--cpu", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(_pinned(args.cpu, args.seconds))
