"""Is this the host a CPU calibration was measured on, running at the speed it ran then?

A calibrated profile (data/calibration/cpu.json, experiments/calibrate) prices steps in this host's seconds, so it
describes one host on one day: this shared VM ran the same code about 3x slower on 2026-12-02 than on 2026-11-30,
under the same name and CPU model. A profile is therefore stamped with a probe: the CPU model, the core count and the
time of a fixed piece of work shaped like the engine's CPU steps (small single-thread matmuls and the Python around
them). Comparing a fresh probe with the stamp says whether simulated seconds can be compared with real ones here.
"""
from __future__ import annotations

import os
import statistics
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
    ratio = now["probe_s"] / stamp["probe_s"]
    if abs(ratio - 1) > TOLERANCE:
        problems.append(f"the probe takes {ratio:.2f}x its time at profiling ({now['probe_s'] * 1e3:.1f} ms vs "
                        f"{stamp['probe_s'] * 1e3:.1f} ms)")
    return problems
