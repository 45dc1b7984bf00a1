"""The router service's own cost: added latency, throughput and CPU per request, with stub workers on loopback.

Four processes: stub workers (two aiohttp apps answering a fixed ~290-byte completion JSON), the router
(``framework.serving.router`` through ``serve_router``, round_robin policy, one pooled ClientSession), a bare aiohttp
proxy (the same server and client session with nothing else: no validation, policy, retries or bookkeeping), and this
client: a minimal keep-alive HTTP/1.1 client on asyncio protocols, so that on a 2-core machine most of the CPU goes to
what is measured. Bodies are 2 KB ``/v1/completions`` requests.

The bare proxy is a naive aiohttp proxy: aiohttp's and Python's defaults, including the per-request timer of
ClientTimeout(total=300) and the default garbage-collector thresholds. The router avoids both (its silence timeout is
one periodic sweep; ``serve_router`` tunes the collector), so at c=256 it can cost less CPU than the bare proxy.

  concurrency 1:   latency through the router vs straight to a stub -> added p50 / p99
  concurrency 256: requests/s through the router
  router CPU:      time.process_time() of the router process (``GET /router_stats``) / requests

Each phase runs ``--reps`` times, interleaved across router and bare proxy, so that load from other processes on the
machine hits both alike; the table quotes medians over reps and the router / bare-proxy ratios.

    python experiments/bench_router/bench_http.py       # ~30-50 s, writes experiments/bench_router/results_http.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTENT_LENGTH = re.compile(rb"(?i)content-length:\s*(\d+)")
TARGETS = {"router_cpu_us_per_req": 200.0, "added_p50_ms": 0.4, "throughput_c256_req_s": 4000.0}
STUB_BODY = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 2000, "completion_tokens": 1, "total_tokens": 2001,
              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()


# ----------------------------------------------------------------------------- server roles (child processes)


async def run_stubs(ports: list[int]) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=STUB_BODY, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    for port in ports:
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_post("/generate", answer)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def run_bare_proxy(port: int, workers: list[str]) -> None:
    """The floor: the same aiohttp server + one pooled ClientSession, with no validation, policy or bookkeeping."""
    import itertools

    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    upstream = itertools.cycle([w + "/v1/completions" for w in workers])

    async def forward(request: web.Request) -> web.Response:
        raw = await request.read()
        async with session.post(next(upstream), data=raw, headers={"Content-Type": "application/json"}) as up:
            body = await up.read()
        return web.Response(body=body, status=up.status, content_type="application/json")

    async def cpu(request: web.Request) -> web.Response:
        return web.json_response({"process_cpu_s": time.process_time()})

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/router_stats", cpu)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def run_router(port: int, workers: list[str]) -> None:
    from framework.registry import ROUTING
    from framework.serving.router import serve_router
    from framework.serving.router_config import RouterServiceConfig

    cfg = RouterServiceConfig(host="127.0.0.1", port=port, health_check_interval_secs=5.0)
    await serve_router(ROUTING.get("round_robin")(), workers, cfg)


# ----------------------------------------------------------------------------- the client


class _Conn(asyncio.Protocol):
    """One keep-alive connection; responses must carry Content-Length (the router's and the stubs' JSON do)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.need = -1
        self.status = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.buf[:i])
            self.status = int(head[9:12])
            self.need = i + 4 + int(CONTENT_LENGTH.search(head).group(1))
        if len(self.buf) >= self.need:
            del self.buf[:self.need]
            self.need = -1
            self.waiter.set_result(self.status)

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, raw: bytes) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


def request_bytes(port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def load(port: int, body: bytes, concurrency: int, requests: int,
               max_s: float = float("inf")) -> tuple[list[float], float]:
    """Up to ``requests`` requests (fewer if ``max_s`` runs out) over ``concurrency`` connections
    -> (latencies in s, wall seconds)."""
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_Conn, "127.0.0.1", port))[1] for _ in range(concurrency)]
    raw = request_bytes(port, "/v1/completions", body)
    latencies: list[float] = []
    left = requests

    deadline = time.perf_counter() + max_s

    async def worker(conn: _Conn) -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            t0 = time.perf_counter()
            status = await conn.request(raw)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"request failed with HTTP {status}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        c.transport.close()
    return latencies, wall


async def get_json(port: int, path: str, method: str = "GET") -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


async def wait_up(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listening on port {port} after {timeout}s")
            await asyncio.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def measure(port: int, body: bytes, concurrency: int, requests: int, max_s: float, cpu: bool) -> dict:
    """One phase against ``port``: latency percentiles, requests/s and (``cpu``) that server's CPU per request."""
    cpu0 = (await get_json(port, "/router_stats"))["process_cpu_s"] if cpu else 0.0
    lat, wall = await load(port, body, concurrency, requests, max_s)
    cpu1 = (await get_json(port, "/router_stats"))["process_cpu_s"] if cpu else 0.0
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "req_s": len(lat) / wall,
            "cpu_us_per_req": (cpu1 - cpu0) / len(lat) * 1e6, "requests": len(lat)}


async def bench(args, ports: dict[str, int], stub_ports: list[int]) -> dict:
    body = json.dumps({"model": "stub", "prompt": "x" * 1950, "max_tokens": 16}).encode()
    for p in (*ports.values(), *stub_ports):
        await wait_up(p)
    while (await get_json(ports["router"], "/health"))["healthy_workers"] < len(stub_ports):
        await asyncio.sleep(0.1)
    for p in ports.values():
        await load(p, body, 16, 2000, max_s=2.0)  # warm-up: connection pools, code paths
    runs: dict[str, list[dict]] = {k: [] for k in ("direct_c1", "bare_c1", "router_c1", "bare_c256", "router_c256")}
    for _ in range(args.reps):  # interleaved, so that a burst of load from elsewhere hits every variant alike
        c1, c256 = (args.c1_requests, args.phase_max_s / 2), (args.c256_requests, args.phase_max_s)
        runs["direct_c1"].append(await measure(stub_ports[0], body, 1, *c1, cpu=False))
        for name in ("bare", "router"):
            runs[f"{name}_c1"].append(await measure(ports[name], body, 1, *c1, cpu=True))
        for name in ("bare", "router"):
            runs[f"{name}_c256"].append(await measure(ports[name], body, 256, *c256, cpu=True))
    med = {f"{phase}_{k}": statistics.median(r[k] for r in rs) for phase, rs in runs.items() for k in rs[0]}
    stats = await get_json(ports["router"], "/router_stats")
    return {
        "body_bytes": len(body), "reps": args.reps,
        "c1_requests": statistics.median(r["requests"] for r in runs["router_c1"]),
        "c256_requests": statistics.median(r["requests"] for r in runs["router_c256"]),
        "direct_p50_ms": med["direct_c1_p50_ms"], "direct_p99_ms": med["direct_c1_p99_ms"],
        "router_p50_ms": med["router_c1_p50_ms"], "router_p99_ms": med["router_c1_p99_ms"],
        "added_p50_ms": med["router_c1_p50_ms"] - med["direct_c1_p50_ms"],
        "added_p99_ms": med["router_c1_p99_ms"] - med["direct_c1_p99_ms"],
        "router_cpu_us_per_req_c1": med["router_c1_cpu_us_per_req"],
        "router_cpu_us_per_req_c256": med["router_c256_cpu_us_per_req"],
        "throughput_c256_req_s": med["router_c256_req_s"],
        "c256_p50_ms": med["router_c256_p50_ms"], "c256_p99_ms": med["router_c256_p99_ms"],
        "bare_proxy_added_p50_ms": med["bare_c1_p50_ms"] - med["direct_c1_p50_ms"],
        "bare_proxy_cpu_us_per_req_c1": med["bare_c1_cpu_us_per_req"],
        "bare_proxy_cpu_us_per_req_c256": med["bare_c256_cpu_us_per_req"],
        "bare_proxy_throughput_c256_req_s": med["bare_c256_req_s"],
        "router_vs_bare_cpu_ratio_c256": med["router_c256_cpu_us_per_req"] / med["bare_c256_cpu_us_per_req"],
        "router_vs_bare_throughput_ratio_c256": med["router_c256_req_s"] / med["bare_c256_req_s"],
        "router_decision_us_p50": stats["router_decision_us"]["p50"],
        "router_decision_us_p99": stats["router_decision_us"]["p99"],
        "router_retries": stats["retries"],
        "throughput_c256_per_rep_req_s": [r["req_s"] for r in runs["router_c256"]],
        "router_cpu_us_per_req_c256_per_rep": [r["cpu_us_per_req"] for r in runs["router_c256"]],
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(r: dict) -> None:
    t = TARGETS
    cpu = max(r["router_cpu_us_per_req_c1"], r["router_cpu_us_per_req_c256"])
    rows = [
        ("", "servelab router", "bare aiohttp proxy", "target"),
        ("added latency p50, c=1 (ms)", f"{r['added_p50_ms']:.3f}", f"{r['bare_proxy_added_p50_ms']:.3f}",
         f"< {t['added_p50_ms']}  {_verdict(r['added_p50_ms'] < t['added_p50_ms'])}"),
        ("added latency p99, c=1 (ms)", f"{r['added_p99_ms']:.3f}", "", ""),
        ("throughput, c=256 (req/s)", f"{r['throughput_c256_req_s']:.0f}",
         f"{r['bare_proxy_throughput_c256_req_s']:.0f}",
         f"> {t['throughput_c256_req_s']:.0f}  {_verdict(r['throughput_c256_req_s'] > t['throughput_c256_req_s'])}"),
        ("CPU per request, c=1 (us)", f"{r['router_cpu_us_per_req_c1']:.0f}", f"{r['bare_proxy_cpu_us_per_req_c1']:.0f}",
         ""),
        ("CPU per request, c=256 (us)", f"{r['router_cpu_us_per_req_c256']:.0f}",
         f"{r['bare_proxy_cpu_us_per_req_c256']:.0f}",
         f"< {t['router_cpu_us_per_req']:.0f}  {_verdict(cpu < t['router_cpu_us_per_req'])}"),
        ("latency p50 / p99, c=256 (ms)", f"{r['c256_p50_ms']:.1f} / {r['c256_p99_ms']:.1f}", "", ""),
        ("policy.select p50 / p99 (us)", f"{r['router_decision_us_p50']:.1f} / {r['router_decision_us_p99']:.1f}", "",
         ""),
    ]
    print(f"router HTTP overhead: {r['body_bytes']}-byte bodies, stub p50 {r['direct_p50_ms']:.3f} ms direct, "
          f"median of {r['reps']} reps")
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"  router / bare proxy: CPU x{r['router_vs_bare_cpu_ratio_c256']:.2f}, "
          f"throughput x{r['router_vs_bare_throughput_ratio_c256']:.2f} (c=256)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "stubs", "router", "bare_proxy"], default="bench")
    ap.add_argument("--ports", default="", help="stubs: comma-separated ports; router: its port")
    ap.add_argument("--workers", default="", help="router: comma-separated worker URLs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--c1-requests", type=int, default=1000)
    ap.add_argument("--c256-requests", type=int, default=8000)
    ap.add_argument("--phase-max-s", type=float, default=4.0,
                    help="a c=256 phase stops after this long (a c=1 phase after half), whatever its request count")
    ap.add_argument("--out", default=str(HERE / "results_http.json"))
    args = ap.parse_args()
    if args.role == "stubs":
        return asyncio.run(run_stubs([int(p) for p in args.ports.split(",")]))
    if args.role in ("router", "bare_proxy"):
        serve = run_router if args.role == "router" else run_bare_proxy
        return asyncio.run(serve(int(args.ports), args.workers.split(",")))

    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    stub_ports, ports = [free_port(), free_port()], {"router": free_port(), "bare": free_port()}
    me = [sys.executable, str(Path(__file__).resolve())]
    workers = ",".join(f"http://127.0.0.1:{p}" for p in stub_ports)
    procs = [subprocess.Popen([*me, "--role", "stubs", "--ports", ",".join(map(str, stub_ports))]),
             subprocess.Popen([*me, "--role", "router", "--ports", str(ports["router"]), "--workers", workers]),
             subprocess.Popen([*me, "--role", "bare_proxy", "--ports", str(ports["bare"]), "--workers", workers])]
    try:
        results = asyncio.run(bench(args, ports, stub_ports))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    results["targets"] = TARGETS
    report(results)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
