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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
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
