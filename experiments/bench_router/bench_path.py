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

    python experiments/bench_router/bench_path.py [--requests 20000] [--reps 7] [--profile] [--opcodes]
        [--traffic bench|real]   (real: a client library's 15-header head and a worker's Date, lengths varying)
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


def traffic_bytes(traffic: str) -> tuple[list[bytes], list[list[bytes]]]:
    """The requests a client sends and, for each second (every 4,000 requests), the answers a worker gives.
    ``bench``: bench_http's (one request, one stub answer). ``real``: the OpenAI Python client's head (15 headers)
    with the prompt's length, so Content-Length, over 64 values, and an SGLang (uvicorn) worker's answer, with a
    Date that changes each second and a Content-Length over 64 values."""
    if traffic == "bench":
        return [request_bytes(1, "/v1/completions", json.dumps(
            {"model": "stub", "prompt": "x" * 1950, "max_tokens": 16}).encode())], [[ANSWER]]
    raws = []
    for k in range(64):
        body = json.dumps({"model": "stub", "prompt": "x" * (1920 + k), "max_tokens": 16}).encode()
        raws.append(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:30000\r\nAccept-Encoding: gzip, deflate\r\n"
                    b"Connection: keep-alive\r\nAccept: application/json\r\nContent-Type: application/json\r\n"
                    b"User-Agent: OpenAI/Python 1.54.4\r\nX-Stainless-Lang: python\r\n"
                    b"X-Stainless-Package-Version: 1.54.4\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
                    b"X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.7\r\n"
                    b"Authorization: Bearer sk-bench\r\nX-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    answers = [[b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 07:00:%02d GMT\r\nserver: uvicorn\r\ncontent-length: %d\r\n"
                b"content-type: application/json\r\n\r\n%s" % (sec, len(STUB_BODY) + k, STUB_BODY + b" " * k)
                for k in range(64)] for sec in range(60)]
    return raws, answers


async def run(requests: int, reps: int, profile: bool, opcodes: bool = False, traffic: str = "bench") -> dict:
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
    raws, answers = traffic_bytes(traffic)
    sent = 0

    def one() -> None:
        nonlocal sent
        sent += 1
        client.data_received(raws[sent % len(raws)])
        for up in ups.values():   # the one the request went to answers it
            if up.transport.out:
                up.transport.out.clear()
                up.data_received(answers[sent // 4000 % len(answers)][sent * 7 % len(answers[0])])
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
    result = {"requests": requests, "reps": reps, "traffic": traffic, "us_per_request_median": statistics.median(times),
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
    ap.add_argument("--traffic", choices=["bench", "real"], default="bench",
                    help="bench: bench_http's identical requests and stub answers; real: a client library's head "
                         "(15 headers) and a worker's answers (Date, Server), their lengths varying (traffic_bytes)")
    ap.add_argument("--out", default=None, help="a results file to write (JSON)")
    args = ap.parse_args()
    import uvloop
    r = uvloop.run(run(args.requests, args.reps, args.profile, args.opcodes, args.traffic))
    print(f"router request path in process (no sockets): {r['us_per_request_median']:.1f} us CPU per request "
          f"(median of {args.reps}; min {r['us_per_request_min']:.1f})"
          + (f", {r['python_and_c_calls_per_request']:.0f} calls per request (cProfile)" if args.profile else "")
          + (f", {r['bytecodes_per_request']:.0f} bytecodes and {r['python_calls_per_request']:.0f} Python calls per "
             f"request" if args.opcodes else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
