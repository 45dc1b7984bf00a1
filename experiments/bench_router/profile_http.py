"""Where servelab's router spends its CPU per request: the router as it runs in a cluster (its own server, uvloop,
round robin over two stub workers: bench_http.py's), profiled with cProfile in this process while bench_http.py's
client sends 2 KB ``/v1/completions`` requests over 256 connections from another process.

Prints the CPU per request (the process's CPU time over the profiled load / requests: cProfile's own overhead
included, so higher than bench_http.py's figure), the share of the profiled time by area (cProfile's clock is
wall time: time spent in a kernel call counts where it was made, the socket writes in ``Connection.send`` and the
upstream request; a loaded machine's preemption spreads over all alike) (the HTTP server, the upstream client,
the service's request handling, validation, the router core and policy, the event loop and the rest), and the top
functions by own time; writes profile_http.txt beside this script.

    python experiments/bench_router/profile_http.py [--requests 20000]

``--perf``: the whole process instead, Python, C libraries and kernel alike: servelab's router and the 60-line proxy
(bench_http.py's roles) each run as a process of their own under ``perf record -g -p`` (/usr/bin/perf; a process may
profile its own children at perf_event_paranoid 2) while the same client loads it; prints each one's user and system
CPU per request (/proc), its involuntary context switches per request, and that CPU split by library and by kernel
path (perf's shares of the process's samples times its CPU per request); writes profile_http_perf.txt.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
BENCH = str(HERE / "bench_http.py")
AREAS = (("HTTP server (server.py; its socket writes)", "serving/router/server.py"),
         ("upstream client (upstream.py; its socket writes)", "upstream.py"),
         ("request handling (service.py, flight.py, wire.py)", ("service.py", "flight.py", "wire.py")),
         ("front door (security.py, admission.py)", ("security.py", "admission.py")),
         ("validation (pydantic, protocol.py)", ("pydantic", "validate_json", "protocol.py", "errors.py")),
         ("router core and policy", ("framework/routing", "plugins/")), ("timers (health.py)", "health.py"),
         ("httptools parsing", "httptools"), ("event loop and sockets (uvloop, asyncio)", ("uvloop", "asyncio")))


def area_of(filename: str) -> str:
    for name, needles in AREAS:
        if any(n in filename for n in ((needles,) if isinstance(needles, str) else needles)):
            return name
    return "other (builtins: bytes, dict, json)"


async def profiled(requests: int, concurrency: int) -> tuple[pstats.Stats, float, int]:
    from framework.core.ports import free_ports
    from framework.core.registry import ROUTING
    from framework.serving.router.config import RouterServiceConfig
    from framework.serving.router.service import start_router
    from bench_http import wait_up

    stub_ports = free_ports("127.0.0.1", 2)
    stubs = subprocess.Popen([sys.executable, BENCH, "--role", "stubs", "--stubs", "fast", "--ports", ",".join(map(str, stub_ports))])
    try:
        for p in stub_ports:
            await wait_up(p)
        server = await start_router(ROUTING.get("round_robin")(), [f"http://127.0.0.1:{p}" for p in stub_ports],
                                    RouterServiceConfig(health_check_interval_secs=5.0), port=0)
        client = [sys.executable, BENCH, "--role", "client", "--ports", str(server.port),
                  "--concurrency", str(concurrency)]
        warm = await asyncio.create_subprocess_exec(*client, "--c256-requests", "3000", stdout=subprocess.PIPE)
        await warm.communicate()
        prof = cProfile.Profile()  # perf_counter: cheap to read (process_time, a syscall each, would swamp the figures)
        cpu0 = time.process_time()
        prof.enable()
        run = await asyncio.create_subprocess_exec(*client, "--c256-requests", str(requests), stdout=subprocess.PIPE)
        out, _ = await run.communicate()
        prof.disable()
        cpu = time.process_time() - cpu0
        await server.cleanup()
        return pstats.Stats(prof), cpu, json.loads(out)["requests"]
    finally:
        stubs.terminate()
        stubs.wait(10)


# --perf: where a proxy process's CPU goes, by library (perf's dso) and by kernel path (perf's symbols, inclusive)
PERF_DSOS = (("libpython (the Python path)", "libpython"), ("httptools (llhttp)", "parser.cpython"),
             ("pydantic-core", "_pydantic_core"), ("uvloop", "loop.cpython"), ("libc", "libc.so"),
             ("kernel, all", "[kernel.kallsyms]"))
PERF_KERNEL = (("kernel: socket writes (to the peer's receive and wake-up)", "ksys_write"),
               ("kernel: socket reads", "ksys_read"), ("kernel: scheduling (context switches)", "schedule"))


def _proc(pid: int) -> tuple[float, float, int]:
    """(user s, system s, involuntary context switches) of a process so far."""
    import re
    from framework.core.proc import cpu_times
    status = Path(f"/proc/{pid}/status").read_text()
    return (*cpu_times(pid), int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status).group(1)))


def _shares(data: str, args: list[str]) -> dict[str, float]:
    """perf report's first column (percent of samples) by its last (the dso or symbol name)."""
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "-g", "none", *args], capture_output=True,
                         text=True).stdout
    shares: dict[str, float] = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0].endswith("%") and not line.startswith("#"):
            name = parts[-1] if args[-1] == "dso" else parts[-3] if parts[-1] == "-" else parts[-1]
            shares[name] = shares.get(name, 0.0) + float(parts[0][:-1])
    return shares


def perf_profile(role: str, requests: int, concurrency: int, data: str) -> dict:
    """One proxy process (bench_http.py's ``role``) under perf record while the client sends ``requests``."""
    import signal
    from framework.core.ports import free_ports
    from bench_http import wait_up

    *stub_ports, port = free_ports("127.0.0.1", 3)     # one call: the three are distinct
    procs = [subprocess.Popen([sys.executable, BENCH, "--role", "stubs", "--ports", ",".join(map(str, stub_ports))])]
    client = [sys.executable, BENCH, "--role", "client", "--ports", str(port), "--concurrency", str(concurrency)]
    try:
        for p in stub_ports:  # up before the router, whose first health check (before it listens) then passes
            asyncio.run(wait_up(p))
        procs.append(subprocess.Popen([sys.executable, BENCH, "--role", role, "--uvloop", "--ports", str(port),
                                       "--workers", ",".join(f"http://127.0.0.1:{p}" for p in stub_ports)]))
        asyncio.run(wait_up(port))
        subprocess.run([*client, "--c256-requests", "3000"], check=True, capture_output=True)  # warm
        pid = procs[1].pid
        perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-q", "-o", data, "-p", str(pid)])
        time.sleep(0.5)
        u0, s0, v0 = _proc(pid)
        out = subprocess.run([*client, "--c256-requests", str(requests)], check=True, capture_output=True).stdout
        u1, s1, v1 = _proc(pid)
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    n = json.loads(out)["requests"]
    user, system = (u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6
    dsos = _shares(data, ["--no-children", "--sort", "dso"])
    syms = _shares(data, ["--children", "--sort", "symbol"])
    total = user + system
    split = {name: sum(v for k, v in dsos.items() if needle in k) / 100 * total for name, needle in PERF_DSOS}
    split.update({name: syms.get(sym, 0.0) / 100 * total for name, sym in PERF_KERNEL})
    return {"requests": n, "user_us": user, "system_us": system, "involuntary_switches": (v1 - v0) / n,
            "split_us": split}


def perf_main(requests: int, concurrency: int) -> None:
    import shutil
    import tempfile
    if shutil.which("perf") is None:
        raise SystemExit("--perf needs perf (linux-perf) on PATH")
    roles = {"servelab router": "router", "60-line proxy": "minimal_proxy"}
    with tempfile.TemporaryDirectory() as tmp:
        res = {name: perf_profile(role, requests, concurrency, f"{tmp}/{role}.data") for name, role in roles.items()}
    rows = [("per request, c=%d (us)" % concurrency, *res)]
    rows += [("user CPU (/proc)", *(f"{r['user_us']:.1f}" for r in res.values())),
             ("system CPU (/proc)", *(f"{r['system_us']:.1f}" for r in res.values())),
             ("involuntary context switches", *(f"{r['involuntary_switches']:.2f}" for r in res.values()))]
    rows += [(name, *(f"{r['split_us'][name]:.1f}" for r in res.values()))
             for name, _ in (*PERF_DSOS, *PERF_KERNEL)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"the proxy processes under perf record -g (their CPU includes perf's own cost), {requests} requests each "
             f"at c={concurrency}; the split: perf's share of the process's samples x its CPU per request"]
    lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    text = "\n".join(lines)
    print(text)
    (HERE / "profile_http_perf.txt").write_text(text + "\n")
    print(f"wrote {HERE / 'profile_http_perf.txt'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--perf", action="store_true", help="profile the whole router and 60-line proxy processes with "
                    "perf (libraries and kernel too); writes profile_http_perf.txt")
    args = ap.parse_args()
    if args.perf:
        return perf_main(args.requests, args.concurrency)
    import uvloop
    from framework.serving.http.server_base import tune_gc_for_serving
    tune_gc_for_serving()
    stats, cpu, n = uvloop.run(profiled(args.requests, args.concurrency))
    by_area: dict[str, float] = {}
    for (filename, _, function), (_, _, tottime, _, _) in stats.stats.items():
        area = area_of(function if filename == "~" else filename)  # a builtin: by its name (pydantic's validate_json)
        by_area[area] = by_area.get(area, 0.0) + tottime
    total = sum(by_area.values())
    lines = [f"servelab router under cProfile: {n} requests, c={args.concurrency}, "
             f"{cpu / n * 1e6:.0f} us CPU per request (profiler overhead included)",
             "share of profiled own time by area:"]
    ranked = sorted(by_area.items(), key=lambda kv: -kv[1])
    lines += [f"  {share / total * 100:5.1f}%  {name}" for name, share in ranked]
    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("tottime").print_stats(args.top)
    lines += ["", f"top {args.top} functions by own time:", buf.getvalue().split("\n\n", 2)[-1].rstrip()]
    text = "\n".join(lines)
    print(text)
    (HERE / "profile_http.txt").write_text(text + "\n")
    print(f"wrote {HERE / 'profile_http.txt'}")


if __name__ == "__main__":
    main()
