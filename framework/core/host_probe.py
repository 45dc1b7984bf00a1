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
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOLERANCE = 0.25        # a probe more than 25% slower or faster than the stamp: another host, for this purpose
COLLECTIVES = 100       # all-reduces timed per Cores.measure (~0.2 s at this VM's ~2 ms each)


def _cpuinfo(field: str) -> str | None:
    """The first value /proc/cpuinfo gives `field` (None: no such line, or no /proc)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    model = _cpuinfo("model name")
    if model is not None:
        return model
    import platform
    return platform.processor() or platform.machine()


def cpu_cache() -> str:
    """/proc/cpuinfo's "cache size" ('' where it reports none: the last level on Intel, as the hypervisor's CPUID
    says; the per-core L2 on AMD): under a hypervisor that names every CPU "Intel(R) Xeon(R) Processor" it tells two
    such CPUs apart."""
    return _cpuinfo("cache size") or ""


def _work() -> float:
    """One probe: 400 small matmul + softmax steps with a Python loop around each (a tiny engine step's shape), timed
    on the thread's CPU clock: how fast its core runs it, not the time the core was taken from it (by another process,
    or by the hypervisor: steal, which this VM's kernel leaves out of a thread's CPU time). A simulation prices those
    apart (`sim.host_background`, `sim.host_steal`); on a wall clock the probe would carry them into the host's scale
    too. On an otherwise idle host the two clocks agree."""
    import torch
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(8, 64, generator=gen), torch.randn(64, 256, generator=gen)
    t0 = time.thread_time()
    acc = 0.0
    for i in range(400):
        h = torch.softmax(a @ w, dim=-1)
        acc += sum(j * 0.5 for j in range(40))     # the scheduler's Python beside each kernel
        a = a + h[:, :64] * 1e-3
    return time.thread_time() - t0


def probe(repeats: int = 5) -> dict:
    """This host now: its CPU model and cache, core count and the probe's median seconds (one torch thread, as
    profiled). A stamp without a cache (taken before it was recorded) is not checked on it."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _work()                                    # warm-up
        seconds = statistics.median(_work() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return {"cpu_model": cpu_model(), "cpu_cache": cpu_cache(), "cpu_count": os.cpu_count(), "probe_s": seconds}


class Cores:
    """The host's cores measured from one warm process pinned to each (started once, so a measurement costs its
    seconds, not a process start and torch's import: cheap enough before every profiled point). ``measure``: the
    probe's work on each core alone in turn, then on every core at once, then the latency of one small all-reduce
    among the processes over gloo (what a step of an instance of several ranks on this host waits on between its
    kernels: this VM, 2026-12-03, ~2 ms each, ~12 of them in a two-rank step of the tiny model, against ~10 ms of
    compute; on a host of N cores it is an N-way all-reduce). Its speed alone is ``pinned``'s work, timed in these
    processes rather than in the caller's. Where cores cannot be pinned (one core, or no sched_setaffinity) no process
    starts: contention 1.0 and no collective."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Cores":
        if len(self.cpus) < 2:
            return self
        import socket
        with socket.socket() as sock:                                      # a free port for the processes' group
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        try:
            for rank, cpu in enumerate(self.cpus):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "framework.core.host_probe", "--cpu", str(cpu), "--rank", str(rank),
                     "--world", str(len(self.cpus)), "--port", str(port)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]))
            for cpu, proc in zip(self.cpus, self.procs):                   # imported, warmed up, in their group
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the host probe pinned to core {cpu} did not start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()                                     # its loop ends at end of input
                except BrokenPipeError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs = []

    def _ask(self, procs: list[subprocess.Popen], line: str) -> list[float]:
        try:
            for proc in procs:                                             # all start together
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError("a host probe pinned to a core has exited") from None
        out = [proc.stdout.readline() for proc in procs]
        if not all(out):
            raise RuntimeError("a host probe pinned to a core stopped answering")
        return [float(x) for x in out]

    def measure(self, seconds: float, collectives: int = COLLECTIVES) -> dict:
        """``alone_s`` / ``together_s``: each core's mean probe time alone, then with every core busy; ``pinned_s``:
        the mean alone (host_probe.pinned's speed); ``contention``: the mean together / the mean alone;
        ``collective_s``: the mean seconds of one all-reduce among the cores' processes (``collectives`` of them;
        None without pinned processes)."""
        if not self.procs:
            if len(self.cpus) >= 2:
                raise RuntimeError("Cores.measure outside its `with` block: no pinned processes started")
            return {"contention": 1.0, "cpus": self.cpus, "alone_s": [], "together_s": [], "pinned_s": pinned(seconds),
                    "collective_s": None}
        alone = [self._ask([proc], f"work {seconds}")[0] for proc in self.procs]
        together = self._ask(self.procs, f"work {seconds}")
        collective = self._ask(self.procs, f"allreduce {collectives}")[0]
        return {"contention": statistics.fmean(together) / statistics.fmean(alone), "cpus": self.cpus,
                "alone_s": alone, "together_s": together, "pinned_s": statistics.fmean(alone),
                "collective_s": collective}


def contention(seconds: float = 3.0) -> dict:
    """The host's cores alone and together (``Cores.measure`` once): the probe's work repeated for ``seconds`` pinned
    to each core alone, then to every core at once; ``contention`` = the mean time together / the mean alone (1.0
    where cores cannot be pinned)."""
    with Cores() as cores:
        return cores.measure(seconds)


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


def _serve_core(cpu: int, rank: int, world: int, port: int) -> None:
    """A ``Cores`` process: pinned to ``cpu``, warmed up, in a gloo group of ``world`` (one per core); then for each
    line of input, ``work S`` (the probe's work repeated S seconds: its mean time) or ``allreduce N`` (N all-reduces
    of a small tensor after a barrier: the mean time of one), the figure printed; ends at end of input."""
    import torch
    import torch.distributed as dist
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))    # a sibling that died: fail, not wait 30 min
    x = torch.ones(8, 256)          # a few rows of hidden states: the size of a tiny model's step's exchange
    _work()
    for _ in range(5):
        dist.all_reduce(x)
    print("ready", flush=True)
    for line in sys.stdin:
        what, arg = line.split()
        if what == "work":
            print(_window(float(arg)), flush=True)
            continue
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(int(arg)):
            dist.all_reduce(x)
        print((time.perf_counter() - t0) / int(arg), flush=True)
    dist.destroy_process_group()


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
    if stamp.get("cpu_cache") and now.get("cpu_cache") and stamp["cpu_cache"] != now["cpu_cache"]:
        problems.append(f"a {now['cpu_cache']} cache, profiled on {stamp['cpu_cache']} (another CPU under the same "
                        f"model name)")
    if stamp.get("cpu_count") != now["cpu_count"]:
        problems.append(f"{now['cpu_count']} cores, profiled on {stamp.get('cpu_count')}")
    key, what = ("pinned_s", "the pinned probe") if stamp.get("pinned_s") and now.get("pinned_s") else \
        ("probe_s", "the probe")       # pinned where both have it: the unpinned probe moves as it is placed
    ratio = now[key] / stamp[key]
    if abs(ratio - 1) > TOLERANCE:
        problems.append(f"{what} takes {ratio:.2f}x its time at profiling ({now[key] * 1e3:.1f} ms vs "
                        f"{stamp[key] * 1e3:.1f} ms)")
    return problems


if __name__ == "__main__":           # one of ``Cores``' pinned processes
    ap = argparse.ArgumentParser(description="one of host_probe.Cores' processes: pinned to --cpu, rank --rank of "
                                             "--world in a gloo group at 127.0.0.1:--port; answers its input's lines")
    for flag in ("--cpu", "--rank", "--world", "--port"):
        ap.add_argument(flag, type=int, required=True)
    args = ap.parse_args()
    _serve_core(args.cpu, args.rank, args.world, args.port)
