"""The router service's own cost: added latency, throughput and CPU per request, with stub workers on loopback,
beside the other proxies that could stand where it stands, all in the same run.

Processes: stub workers (two servers in one process answering a fixed ~290-byte completion JSON: asyncio protocols +
httptools on uvloop, ``--stubs fast``, so that the stubs' process is not what caps a proxy's throughput; ``--stubs
aiohttp``: aiohttp apps, the harness before, whose process saturated near 6,500 req/s); the proxies compared, each
round-robin in front of the same stubs: servelab's router as it runs in a cluster (``router``: its own HTTP server on
asyncio protocols + httptools, pooled kept-alive upstream connections, uvloop's event loop; ``serve_router``), the
same on asyncio's own loop (``router_asyncio``), the same ``Router`` behind an aiohttp app on uvloop
(``router_aiohttp``: the aiohttp shell, close to what the router cost before it had its own server), SGLang's own
router (sglang-router 0.3.2, Rust, when installed: ``framework.cluster.peer_router``), a bare aiohttp proxy (aiohttp's
server and one pooled ClientSession with nothing else: no validation, policy, retries or bookkeeping), and the floor
of the design the router uses (``minimal``: round robin on asyncio protocols + httptools + uvloop with kept-alive
upstream connections and no feature at all); and this client, a minimal keep-alive HTTP/1.1 client on asyncio
protocols and uvloop, so that on a 2-core machine
most of the CPU goes to what is measured. Bodies are 2 KB ``/v1/completions`` requests. Every servelab variant runs
every feature (validation, policy, retries, deadlines, breaker, request ids, admission and key checks: off by default,
as in a local run, but on the path). Where the remaining time goes: profile_http.py.

The bare proxy is a naive aiohttp proxy: aiohttp's and Python's defaults, including the per-request timer of
ClientTimeout(total=300) and the default garbage-collector thresholds. The router avoids both (its silence timeout is
one periodic sweep; ``serve_router`` tunes the collector), so at c=256 it can cost less CPU than the bare proxy.

  concurrency 1:   latency through each proxy vs straight to a stub -> added p50 / p99
  concurrency 256: requests/s through each proxy
  proxy CPU:       the proxy process's CPU time over a phase / requests (servelab's router and the bare proxy report
                   time.process_time() at ``GET /router_stats``; SGLang's router, all its threads, from /proc)
  harness CPU:     this client's and the stubs' CPU per request at c=256: they share the cores with the proxy, so
                   c=256 throughput is at most cores / (proxy + harness) per request; a one-thread router's, at
                   most one core / its own; the throughput target asks of the router's CPU the tighter of the two
                   (printed, with the one that binds: ``cpu_for_throughput``)

Each phase runs ``--reps`` times, interleaved across the proxies, so that load from other processes on the machine
hits all alike; the table quotes medians over reps and the servelab router / other ratios. Load from elsewhere does
not hit all alike in one way: a process CPU-bound on one thread (servelab's router, the Python proxies) gets one
scheduler share where SGLang's router, a thread per core, gets one per core, so on a busy machine the throughput
ratio at c=256 moves towards SGLang whatever the CPU per request.

    python experiments/bench_router/bench_http.py       # ~5 min, writes experiments/bench_router/results_http.json
    python experiments/bench_router/bench_http.py --proxies router --baseline /tmp/base --out /tmp/ab.json
        # A/B of a change: another checkout's router (a copy of the tree before it) interleaved in the same run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from framework.cluster.peer_router import installed_version  # noqa: E402
from framework.core.host_probe import probe  # noqa: E402
from framework.core.proc import cpu_times, host_cpu_s  # noqa: E402
CORES = len(os.sched_getaffinity(0))  # what the harness, the stubs and the proxies share
ROUTER_THREADS = 1                    # servelab's router serves on one event-loop thread
CONTENT_LENGTH = re.compile(rb"(?i)content-length:\s*(\d+)")
# servelab's router against SGLang's, in the same run (issue 22): CPU per request at c=256 <= 0.6x, requests/s at
# c=256 >= 1.5x, added p50 at c=1 <= 1.0x
TARGETS = {"cpu_ratio_c256": 0.6, "throughput_ratio_c256": 1.5, "added_p50_ratio_c1": 1.0}
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


async def run_fast_stubs(ports: list[int]) -> None:
    """The same stub workers at a fraction of the CPU: asyncio protocols + httptools on uvloop, answering the same
    JSON to every POST (and "ok" to GET /health). With aiohttp stubs the stub process saturated its core near 6,500
    req/s, so every proxy's c=256 throughput read that ceiling instead of the proxy's own (issue 22)."""
    import httptools

    loop = asyncio.get_running_loop()
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (len(STUB_BODY), STUB_BODY))
    health = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"

    class Stub(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:   # SGLang's router opens HTTP/2 prior-knowledge ("PRI") first
                self.transport.close()
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_complete(self) -> None:
            self.transport.write(health if self.parser.get_method() == b"GET" else answer)

    for port in ports:
        await loop.create_server(Stub, "127.0.0.1", port, backlog=1024)
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


async def run_minimal_proxy(port: int, workers: list[str]) -> None:
    """The floor of this design (issue 22's 60-line proxy): round robin on asyncio protocols + httptools, kept-alive
    upstream connections, and nothing else (no validation, policy, retries, timeouts, headers but Content-Length)."""
    import itertools
    import httptools

    loop = asyncio.get_running_loop()
    origins = itertools.cycle([(w.rsplit(":", 1)[0].split("//")[1], int(w.rsplit(":", 1)[1])) for w in workers])
    idle: dict[tuple, list] = {}

    class Up(asyncio.Protocol):
        def __init__(self, origin):
            self.origin, self.parser, self.client = origin, httptools.HttpResponseParser(self), None

        def connection_made(self, t):
            self.t = t

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_message_begin(self):
            self.body = []

        def on_body(self, b):
            self.body.append(b)

        def on_message_complete(self):
            client, self.client = self.client, None
            idle.setdefault(self.origin, []).append(self)
            client.answer(self.parser.get_status_code(), b"".join(self.body))

    class Down(asyncio.Protocol):
        def __init__(self):
            self.parser = httptools.HttpRequestParser(self)

        def connection_made(self, t):
            self.t = t

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_message_begin(self):
            self.body = []

        def on_body(self, b):
            self.body.append(b)

        def on_message_complete(self):
            loop.create_task(self.forward(b"".join(self.body)))

        async def forward(self, body):
            origin = next(origins)
            pool = idle.get(origin)
            up = pool.pop() if pool else (await loop.create_connection(lambda: Up(origin), *origin))[1]
            up.client = self
            up.t.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

        def answer(self, status, body):
            self.t.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (status, len(body), body))

    async def cpu(reader, writer):  # GET /router_stats: the process's CPU, on a port of its own (port + 1)
        await reader.readuntil(b"\r\n\r\n")
        body = json.dumps({"process_cpu_s": time.process_time()}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    await loop.create_server(Down, "127.0.0.1", port, backlog=1024)
    await asyncio.start_server(cpu, "127.0.0.1", port + 1)
    await asyncio.Event().wait()


async def run_router(port: int, workers: list[str], shell: str = "own") -> None:
    from framework.core.registry import ROUTING
    from framework.serving.router.service import create_router_app, serve_router
    from framework.serving.router.config import RouterServiceConfig

    cfg = RouterServiceConfig(host="127.0.0.1", port=port, health_check_interval_secs=5.0)
    if shell == "own":
        await serve_router(ROUTING.get("round_robin")(), workers, cfg)
        return
    from framework.serving.http.server_base import serve_forever, tune_gc_for_serving
    app = create_router_app(ROUTING.get("round_robin")(), workers, cfg)
    tune_gc_for_serving()
    await serve_forever(app, cfg.host, cfg.port)


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


async def wait_up(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Until something listens on ``port``; ``proc``, the process that is to listen there: its exit ends the wait
    at once, with its exit code (its own error is above, on the shared stderr)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process that was to listen on port {port} exited with code "
                                   f"{proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listening on port {port} after {timeout}s")
            await asyncio.sleep(0.1)


async def wait_serving(port: int, body: bytes, timeout: float = 30.0) -> None:
    """Until a request through ``port`` is answered 200: SGLang's router listens before it has settled its workers
    (it first opens HTTP/2 prior-knowledge connections to them, the "PRI" the stubs log, and was seen answering the
    warm-up's first request 503, which failed the whole run)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await load(port, body, 1, 1)
            return
        except (RuntimeError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {port} did not answer a request with 200 within {timeout}s: {exc}") from exc
            await asyncio.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def measure(port: int, body: bytes, concurrency: int, requests: int, max_s: float, cpu,
                  harness=None) -> dict:
    """One phase against ``port``: latency percentiles, requests/s and (given ``cpu``, an async reader of the
    server process's CPU seconds) its CPU per request; and the harness's (``harness``: the CPU seconds of this
    client and the stubs), which shares the machine's cores with what is measured."""
    cpu0 = await cpu() if cpu else 0.0
    h0 = harness() if harness else 0.0
    lat, wall = await load(port, body, concurrency, requests, max_s)
    h1 = harness() if harness else 0.0
    cpu1 = await cpu() if cpu else 0.0
    out = {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "req_s": len(lat) / wall,
           "cpu_us_per_req": (cpu1 - cpu0) / len(lat) * 1e6, "requests": len(lat)}
    if harness:
        out["harness_cpu_us_per_req"] = (h1 - h0) / len(lat) * 1e6
    return out


def cpu_for_throughput(req_s: float, harness_us: float, cores: int, threads: int) -> tuple[float, str]:
    """The most CPU per request (us) a proxy may spend and still serve ``req_s``, and what binds it: its own threads
    (a process on ``threads`` threads uses at most that many cores) or the machine's cores, which it shares with a
    harness spending ``harness_us`` per request."""
    own, machine = threads * 1e6 / req_s, cores * 1e6 / req_s - harness_us
    return (own, "the router's own thread(s)") if own <= machine else (machine, "the cores, shared with the harness")


def stats_cpu(port: int):
    async def read() -> float:            # servelab's router and the bare proxy say it themselves
        return (await get_json(port, "/router_stats"))["process_cpu_s"]
    return read


def proc_cpu(peer):
    async def read() -> float:            # SGLang's router: its process's CPU time from /proc
        return peer.cpu_s()
    return read


async def bench(args, proxies: dict[str, tuple[int, object]], stub_ports: list[int],
                owners: dict[int, subprocess.Popen]) -> dict:
    """``proxies``: name -> (port, CPU reader) of every proxy compared, each in front of the same stubs; ``owners``:
    port -> the process that listens there."""
    stubs_pid = owners[stub_ports[0]].pid

    def harness() -> float:
        return time.process_time() + sum(cpu_times(stubs_pid))
    body = json.dumps({"model": "stub", "prompt": "x" * 1950, "max_tokens": 16}).encode()
    for p in (*(port for port, _ in proxies.values()), *stub_ports):
        await wait_up(p, proc=owners.get(p))
    while (await get_json(proxies["router"][0], "/health"))["healthy_workers"] < len(stub_ports):
        await asyncio.sleep(0.1)
    for port, _ in proxies.values():
        await wait_serving(port, body)
        await load(port, body, 16, 2000, max_s=min(2.0, args.phase_max_s))  # warm-up: connection pools, code paths
    runs: dict[str, list[dict]] = {"direct_c1": [], **{f"{n}_{c}": [] for n in proxies for c in ("c1", "c256")}}
    for _ in range(args.reps):  # interleaved, so that a burst of load from elsewhere hits every variant alike
        c1, c256 = (args.c1_requests, args.phase_max_s / 2), (args.c256_requests, args.phase_max_s)
        runs["direct_c1"].append(await measure(stub_ports[0], body, 1, *c1, cpu=None))
        for name, (port, cpu) in proxies.items():
            runs[f"{name}_c1"].append(await measure(port, body, 1, *c1, cpu=cpu))
        for name, (port, cpu) in proxies.items():
            runs[f"{name}_c256"].append(await measure(port, body, 256, *c256, cpu=cpu, harness=harness))
    med = {f"{phase}_{k}": statistics.median(r[k] for r in rs) for phase, rs in runs.items() for k in rs[0]}
    stats = await get_json(proxies["router"][0], "/router_stats")
    out = {"body_bytes": len(body), "reps": args.reps, "proxies": list(proxies), "stubs": args.stubs,
           "direct_p50_ms": med["direct_c1_p50_ms"], "direct_p99_ms": med["direct_c1_p99_ms"],
           "router_decision_us_p50": stats["router_decision_us"]["p50"],
           "router_decision_us_p99": stats["router_decision_us"]["p99"], "router_retries": stats["retries"]}
    for n in proxies:       # per proxy: added latency at c=1, CPU per request at c=1 and c=256, c=256 throughput
        out.update({f"{n}_added_p50_ms": med[f"{n}_c1_p50_ms"] - med["direct_c1_p50_ms"],
                    f"{n}_added_p99_ms": med[f"{n}_c1_p99_ms"] - med["direct_c1_p99_ms"],
                    f"{n}_cpu_us_per_req_c1": med[f"{n}_c1_cpu_us_per_req"],
                    f"{n}_cpu_us_per_req_c256": med[f"{n}_c256_cpu_us_per_req"],
                    f"{n}_throughput_c256_req_s": med[f"{n}_c256_req_s"],
                    f"{n}_harness_cpu_us_per_req_c256": med[f"{n}_c256_harness_cpu_us_per_req"],
                    f"{n}_machine_ceiling_c256_req_s": statistics.median(   # each rep's own, then their median
                        CORES * 1e6 / (r["cpu_us_per_req"] + r["harness_cpu_us_per_req"]) for r in runs[f"{n}_c256"]),
                    f"{n}_c256_p50_ms": med[f"{n}_c256_p50_ms"], f"{n}_c256_p99_ms": med[f"{n}_c256_p99_ms"],
                    f"{n}_cpu_us_per_req_c256_per_rep": [r["cpu_us_per_req"] for r in runs[f"{n}_c256"]]})
    for n in proxies:
        if n != "router":
            out[f"router_vs_{n}_cpu_ratio_c256"] = out["router_cpu_us_per_req_c256"] / out[f"{n}_cpu_us_per_req_c256"]
    if "sglang" in proxies:
        out["router_vs_sglang_throughput_ratio_c256"] = (out["router_throughput_c256_req_s"]
                                                         / out["sglang_throughput_c256_req_s"])
        out["router_vs_sglang_added_p50_ratio_c1"] = out["router_added_p50_ms"] / out["sglang_added_p50_ms"]
        need, bound = cpu_for_throughput(TARGETS["throughput_ratio_c256"] * out["sglang_throughput_c256_req_s"],
                                         out["router_harness_cpu_us_per_req_c256"], CORES, ROUTER_THREADS)
        out["router_cpu_us_per_req_for_throughput_target"] = need
        out["router_cpu_ratio_for_throughput_target"] = need / out["sglang_cpu_us_per_req_c256"]
        out["router_throughput_target_bound"] = bound
        out["router_cores_used_c256"] = out["router_cpu_us_per_req_c256"] * out["router_throughput_c256_req_s"] / 1e6
    return out


NAMES = {"router": "servelab router", "router_asyncio": "servelab, asyncio loop",
         "router_aiohttp": "servelab on aiohttp", "sglang": "SGLang router 0.3.2", "bare": "bare aiohttp proxy",
         "minimal": "60-line proxy", "baseline": "servelab, --baseline tree"}


def report(r: dict) -> None:
    t, names = TARGETS, r["proxies"]
    rows = [("", *(NAMES[n] for n in names), "target (servelab / SGLang)")]
    for label, key, fmt, target in (
            ("added latency p50, c=1 (ms)", "added_p50_ms", "{:.3f}", f"<= {t['added_p50_ratio_c1']}x"),
            ("added latency p99, c=1 (ms)", "added_p99_ms", "{:.3f}", ""),
            ("throughput, c=256 (req/s)", "throughput_c256_req_s", "{:.0f}", f">= {t['throughput_ratio_c256']}x"),
            ("CPU per request, c=1 (us)", "cpu_us_per_req_c1", "{:.0f}", ""),
            ("CPU per request, c=256 (us)", "cpu_us_per_req_c256", "{:.0f}", f"<= {t['cpu_ratio_c256']}x"),
            ("harness CPU per request, c=256 (us)", "harness_cpu_us_per_req_c256", "{:.0f}", ""),
            (f"the {CORES} cores' ceiling, c=256 (req/s)", "machine_ceiling_c256_req_s", "{:.0f}", ""),
            ("latency p50, c=256 (ms)", "c256_p50_ms", "{:.1f}", ""),
            ("latency p99, c=256 (ms)", "c256_p99_ms", "{:.1f}", "")):
        rows.append((label, *(fmt.format(r[f"{n}_{key}"]) for n in names), target))
    print(f"router HTTP overhead: {r['body_bytes']}-byte bodies, stub p50 {r['direct_p50_ms']:.3f} ms direct, "
          f"median of {r['reps']} reps, interleaved")
    h = r["host"]
    print(f"host: {h['cpu_model']}, {h['cpu_count']} cores, cache {h['cpu_cache'] or '?'}, probe "
          f"{h['probe_s'] * 1e3:.1f} ms; load average {h['loadavg_1m_before_after'][0]:.2f} -> "
          f"{h['loadavg_1m_before_after'][1]:.2f}, steal {h['steal_cores']:.2f} cores over the run")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    print(f"  servelab policy.select p50 / p99: {r['router_decision_us_p50']:.1f} / "
          f"{r['router_decision_us_p99']:.1f} us")
    for n in names:
        if n != "router":
            print(f"  servelab router / {NAMES[n]}: CPU per request x{r[f'router_vs_{n}_cpu_ratio_c256']:.2f} (c=256)")
    if "sglang" in names:
        met = {k: (r[f"router_vs_sglang_{k}"] <= t[k]) if k != "throughput_ratio_c256" else
               (r[f"router_vs_sglang_{k}"] >= t[k]) for k in t}
        print("  servelab router / SGLang's: " + ", ".join(
            f"{k} {r[f'router_vs_sglang_{k}']:.2f} ({'met' if ok else 'NOT met'})" for k, ok in met.items()))
        print(f"  {t['throughput_ratio_c256']}x SGLang's throughput needs at most "
              f"{r['router_cpu_us_per_req_for_throughput_target']:.0f} us of router CPU per request "
              f"({r['router_cpu_ratio_for_throughput_target']:.2f}x SGLang's; bound by "
              f"{r['router_throughput_target_bound']}); servelab's router used "
              f"{r['router_cores_used_c256']:.2f} cores at c=256")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "stubs", "router", "router_aiohttp", "bare_proxy", "minimal_proxy",
                                       "client"],
                    default="bench")
    ap.add_argument("--ports", default="", help="stubs: comma-separated ports; router: its port")
    ap.add_argument("--workers", default="", help="router: comma-separated worker URLs")
    ap.add_argument("--uvloop", action="store_true", help="router: run on uvloop's event loop")
    ap.add_argument("--concurrency", type=int, default=256, help="client: connections")
    contenders = [n for n in NAMES if n != "baseline"]   # 'baseline' runs only with --baseline DIR
    ap.add_argument("--proxies", nargs="+", default=[n for n in contenders if n != "sglang" or installed_version()],
                    choices=contenders, help="what to compare (default: all that are installed)")
    ap.add_argument("--stubs", choices=["fast", "aiohttp"], default="fast",
                    help="the stub workers: asyncio protocols + httptools on uvloop (default), or aiohttp apps (the "
                         "harness before; their process caps every proxy near 6,500 req/s on 2 cores)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", default=None,
                    help="another checkout's root: its router runs beside this one as proxy 'baseline' (A/B of a "
                         "change in the same run)")
    ap.add_argument("--c1-requests", type=int, default=1000)
    ap.add_argument("--c256-requests", type=int, default=8000)
    ap.add_argument("--phase-max-s", type=float, default=4.0,
                    help="a c=256 phase stops after this long (a c=1 phase after half), whatever its request count")
    ap.add_argument("--out", default=str(HERE / "results_http.json"),
                    help="the results' file; a directory (existing, or named with a trailing /): results_http.json "
                         "in it")
    args = ap.parse_args()
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", "\\")):
        out = out / "results_http.json"
    if args.role == "bench":
        out.parent.mkdir(parents=True, exist_ok=True)  # before the run: a bad --out fails at once, not after it
    if args.role == "stubs":
        if args.stubs == "fast":
            import uvloop
            return uvloop.run(run_fast_stubs([int(p) for p in args.ports.split(",")]))
        return asyncio.run(run_stubs([int(p) for p in args.ports.split(",")]))
    if args.role == "client":  # profile_http.py's load: --c256-requests over --concurrency connections
        body = json.dumps({"model": "stub", "prompt": "x" * 1950, "max_tokens": 16}).encode()
        lat, wall = asyncio.run(load(int(args.ports), body, args.concurrency, args.c256_requests))
        return print(json.dumps({"requests": len(lat), "wall_s": wall}))
    if args.role in ("router", "router_aiohttp", "bare_proxy", "minimal_proxy"):
        run = asyncio.run
        if args.uvloop:
            import uvloop
            run = uvloop.run
        if args.role in ("bare_proxy", "minimal_proxy"):
            proxy = run_bare_proxy if args.role == "bare_proxy" else run_minimal_proxy
            return run(proxy(int(args.ports), args.workers.split(",")))
        return run(run_router(int(args.ports), args.workers.split(","), "own" if args.role == "router" else "aiohttp"))

    from framework.config import compose
    from framework.cluster.peer_router import SglangRouter
    from framework.core.ports import free_ports

    names = ["router", *(n for n in args.proxies if n != "router"), *(["baseline"] if args.baseline else [])]
    stub_ports = free_ports("127.0.0.1", 2)
    ports = {n: free_ports("127.0.0.1", 2)[0] for n in names}  # the minimal proxy reports its CPU on port + 1
    me = [sys.executable, str(Path(__file__).resolve())]
    workers = ",".join(f"http://127.0.0.1:{p}" for p in stub_ports)
    procs = [subprocess.Popen([*me, "--role", "stubs", "--stubs", args.stubs,
                               "--ports", ",".join(map(str, stub_ports))])]
    roles = {"router": ["--role", "router", "--uvloop"], "router_asyncio": ["--role", "router"],
             "router_aiohttp": ["--role", "router_aiohttp", "--uvloop"], "bare": ["--role", "bare_proxy"],
             "minimal": ["--role", "minimal_proxy", "--uvloop"]}
    if args.baseline:
        roles["baseline"] = [str(Path(args.baseline) / "experiments/bench_router/bench_http.py"), "--role", "router",
                             "--uvloop"]
    proxies, peer, started = {}, None, {}
    try:
        for n in names:
            if n == "sglang":
                continue
            cmd = [sys.executable, *roles[n]] if n == "baseline" else [*me, *roles[n]]
            started[n] = subprocess.Popen([*cmd, "--ports", str(ports[n]), "--workers", workers])
            procs.append(started[n])
            proxies[n] = (ports[n], stats_cpu(ports[n] + (n == "minimal")))
        if "sglang" in names:    # the same stubs, round robin, SGLang's defaults otherwise
            asyncio.run(wait_up(stub_ports[0], proc=procs[0]))
            rc = compose(["router=round_robin", "router.impl=sglang", f"router.port={ports['sglang']}"]).router
            peer = SglangRouter(rc, rc, workers.split(","), startup_timeout_s=60)
            proxies["sglang"] = (ports["sglang"], proc_cpu(peer))
        import uvloop   # the client on uvloop too: less of the 2 cores for the harness, more for what is measured
        owners = {**dict.fromkeys(stub_ports, procs[0]), **{ports[n]: proc for n, proc in started.items()}}
        if peer is not None:
            owners[ports["sglang"]] = peer.popen
        load0, (_, steal0), t0 = os.getloadavg()[0], host_cpu_s(), time.monotonic()
        results = uvloop.run(bench(args, proxies, stub_ports, owners))
        # how quiet the machine was: other jobs raise the load average, the hypervisor's steal takes cores away
        quiet = {"loadavg_1m_before_after": [load0, os.getloadavg()[0]],
                 "steal_cores": (host_cpu_s()[1] - steal0) / (time.monotonic() - t0)}
    finally:
        if peer is not None:
            peer.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    results["targets"] = TARGETS
    results["host"] = {**probe(), **quiet}  # the ratios move with the host: say which one, and how busy it was
    results["sglang_router"] = installed_version() if peer is not None else None
    report(results)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
