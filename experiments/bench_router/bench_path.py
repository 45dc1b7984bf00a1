"""The router's request path in process, without sockets: the Python work per proxied request, apart from the
kernel's.

bench_http.py measures the router as a process beside SGLang's, where the CPU per request mixes the router's own
work with its system calls and with the machine's other load. Here the router's own server connection and pooled
worker connections sit on transports that only keep what is written: each request is fed to the client
connection's parser as bytes (a 2 KB ``/v1/completions`` body, as bench_http's client sends), the router writes it
to a worker connection, the worker's answer (bench_http's stub answer) is fed to that connection's parser, and the
router writes the answer to the client. Everything between is the router as it runs (uvloop's loop, round robin,
every feature on the path: validation, the policy, stats, request ids, deadlines, route headers), so the CPU time
per request here is the user time of bench_http's router less what the sockets cost, and small changes show
through the noise of a shared machine (median of ``--reps`` runs of process time).

    python experiments/bench_router/bench_path.py [--requests 20000] [--reps 7] [--profile]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from bench_http import STUB_BODY, request_bytes  # noqa: E402

WORKERS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
          % (len(STUB_BODY), STUB_BODY))


class Kept:
    """A transport that keeps what is written (nothing leaves the process)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return default


async def run(requests: int, reps: int, profile: bool, opcodes: bool = False) -> dict:
    from framework.core.registry import ROUTING
    from framework.serving.router.config import RouterServiceConfig
    from framework.serving.router.server import Connection
    from framework.serving.router.service import Router
    from framework.serving.router.upstream import UpstreamResponse

    router = Router(ROUTING.get("round_robin")(), WORKERS, RouterServiceConfig(host="127.0.0.1", port=0))
    for w in router.workers.values():
        w.healthy = True
    client = Connection(router.on_request, router.cfg.client_max_size, router.extra_headers)
    client.connection_made(Kept())
    ups = {}
    for url in WORKERS:
        origin = router._origin(router.workers[url]).key
        up = UpstreamResponse(router.pool, origin)
        up.connection_made(Kept())
        up.keep_alive = up.complete = True
        up.idle_since = time.monotonic()
        router.pool._idle[origin] = [up]
        ups[origin] = up
    raw = request_bytes(1, "/v1/completions",
                        json.dumps({"model": "stub", "prompt": "x" * 1950, "max_tokens": 16}).encode())

    def one() -> None:
        client.data_received(raw)
        for up in ups.values():   # the one the request went to answers it
            if up.transport.out:
                up.transport.out.clear()
                up.data_received(ANSWER)
                break
        else:
            raise RuntimeError("the request reached no worker")
        out = client.transport.out
        if len(out) != 1 or not out[0].startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected answer: {out[:1]!r}")
        out.clear()

    for _ in range(2000):  # warm: caches of header lines, media types, the policy's state
        one()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(requests):
            one()
        times.append((time.process_time() - t0) / requests * 1e6)
    result = {"requests": requests, "reps": reps, "us_per_request_median": statistics.median(times),
              "us_per_request_min": min(times), "us_per_request": times}
    if opcodes:  # deterministic, unlike CPU time on a shared machine: bytecodes and Python calls per request
        counts = {"opcode": 0, "call": 0}

        def trace(frame, event, arg):
            frame.f_trace_opcodes = True
            if event in counts:
                counts[event] += 1
            return trace

        n = min(requests, 2000)
        sys.settrace(trace)
        try:
            for _ in range(n):
                one()
        finally:
            sys.settrace(None)
        result["bytecodes_per_request"] = counts["opcode"] / n
        result["python_calls_per_request"] = counts["call"] / n
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(requests):
            one()
        prof.disable()
        st = pstats.Stats(prof)
        calls = sum(v[1] for v in st.stats.values())
        result["python_and_c_calls_per_request"] = calls / requests
        st.sort_stats("tottime").print_stats(40)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="then one more run under cProfile: calls per request")
    ap.add_argument("--opcodes", action="store_true",
                    help="then count the bytecodes and Python calls per request (sys.settrace): a measure of the "
                         "Python work that load elsewhere does not move")
    ap.add_argument("--out", default=None, help="a results file to write (JSON)")
    args = ap.parse_args()
    import uvloop
    r = uvloop.run(run(args.requests, args.reps, args.profile, args.opcodes))
    print(f"router request path in process (no sockets): {r['us_per_request_median']:.1f} us CPU per request "
          f"(median of {args.reps}; min {r['us_per_request_min']:.1f})"
          + (f", {r['python_and_c_calls_per_request']:.0f} calls per request (cProfile)" if args.profile else "")
          + (f", {r['bytecodes_per_request']:.0f} bytecodes and {r['python_calls_per_request']:.0f} Python calls per "
             f"request" if args.opcodes else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
