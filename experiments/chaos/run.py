"""Chaos: what a supervised cluster loses, and how fast it recovers, when a worker or the router fails under load.

One cluster (4 engine-instance workers behind the cache-aware router, each in its own process, restarted by the
cluster's supervisor when it dies) serves every scenario in turn; in each, 16 clients (the HTTP load client,
streaming, 2 retries with jittered backoff) play one session per prefix group (16 groups x 6 turns) while one fault
hits one worker mid-run:

- baseline: no fault;
- sigkill_worker: SIGKILL (the worker is restarted and added back);
- sigstop_worker: SIGSTOP for 2 x router.request_timeout_s, then SIGCONT;
- worker_503: a FaultProxy in front of the worker answers every request 503 with Retry-After: 1 for 3 s;
- reset_midstream: the proxy resets every stream of the worker after its first chunk for 3 s (its circuit breaker
  opens; recovery waits for router.breaker_cooldown_secs);
- sigkill_router: SIGKILL of the router process (the clients retry up to 8 times meanwhile).

Columns: requests; lost (requests that failed at the client after its retries); p99 end-to-end latency; recovery
time (from the end of the fault -- the kill, the SIGCONT, the proxy turned off -- until the router routes to that
worker, or answers at all for the router, again); the router's retries and the client's; restarts; and the router's
estimated cache hit rate beside the one the workers measured (n/a when the router restarted: a new router's counters
cover only part of the run).

    python experiments/chaos/run.py            # ~2 minutes on the shared 2-core CPU
    python experiments/chaos/run.py --quick    # fewer requests and scenarios (tests use it)

Prints one table and writes results.json beside this file (or to --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.report.metrics import summarize  # noqa: E402
from framework.cluster.cluster import Cluster, http_json  # noqa: E402
from framework.testing.faults import FaultPlan, FaultProxy  # noqa: E402
from framework.cluster.processes import signal_group  # noqa: E402
from framework.contracts.workload import Session, Turn, random_text  # noqa: E402
from framework.load.http_client import LoadClient  # noqa: E402

SILENCE_S = 2.0
SCENARIOS = ("baseline", "sigkill_worker", "sigstop_worker", "worker_503", "reset_midstream", "sigkill_router")
QUICK = ("baseline", "sigkill_worker")
PROXY_FAULTS = {"worker_503": FaultPlan(error_rate=1.0, error_status=503, retry_after_s=1.0),
                "reset_midstream": FaultPlan(reset_rate=1.0, reset_after_chunks=1)}
FAULT_WINDOW_S = 3.0


def sessions(groups: int, turns: int, seed: int) -> list[Session]:
    """One session per prefix group, its turns one after the other (so the router's estimate is exact when nothing
    fails: a prefix it credits a worker with is in that worker's cache by the group's next request)."""
    rng = random.Random(seed)
    return [Session(f"group-{g}", 0.0, [Turn(random_text(rng, 24), 8) for _ in range(turns)],
                    prefix=random_text(rng, 256) + "\n", carry_history=False) for g in range(groups)]


class Proxy:
    """A FaultProxy in front of one worker, served from a thread."""

    def __init__(self, upstream: str, port: int):
        self.faults = FaultProxy(upstream)
        self.url = f"http://127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.faults.app(), handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def routed(router_url: str, url: str) -> bool:
    try:
        workers = http_json("GET", router_url + "/list_workers", timeout=2)["workers"]
    except OSError:
        return False
    return any(w["url"] == url and w["routable"] for w in workers)


def wait(predicate, timeout: float = 120.0) -> float:
    t0 = time.monotonic()
    while not predicate() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return time.monotonic() - t0


def run_scenario(name: str, c: Cluster, cfg, proxy: Proxy, groups: int, turns: int, seed: int) -> dict:
    http_json("POST", c.router_url + "/flush_cache", data=b"")
    c.router_stats(reset=True)
    restarts0 = c.restarts()
    target = proxy.url if name in PROXY_FAULTS else c.worker_urls[1]
    client = LoadClient(c.router_url, cfg.workload, retries=8 if name == "sigkill_router" else 2,
                        request_timeout_s=120)
    out = {}
    player = threading.Thread(target=lambda: out.update(result=client.play(sessions(groups, turns, seed))))
    player.start()
    while len(client.records) < groups * turns // 4 and player.is_alive():
        time.sleep(0.01)
    recovery = 0.0
    if name == "sigkill_worker":
        c.kill_worker(1)
        recovery = wait(lambda: not routed(c.router_url, target), 10) + wait(lambda: routed(c.router_url, target))
    elif name == "sigstop_worker":
        c.kill_worker(1, signal.SIGSTOP)
        time.sleep(2 * SILENCE_S)
        c.kill_worker(1, signal.SIGCONT)
        recovery = wait(lambda: routed(c.router_url, target))
    elif name in PROXY_FAULTS:
        proxy.faults.set_plan(PROXY_FAULTS[name])
        time.sleep(FAULT_WINDOW_S)
        proxy.faults.set_plan(FaultPlan())
        recovery = wait(lambda: routed(c.router_url, target))
    elif name == "sigkill_router":
        signal_group(c.router.popen, signal.SIGKILL)
        recovery = wait(lambda: _answers(c.router_url))
    player.join()
    records, duration = out["result"]
    router = c.router_stats()  # a restarted router counts from its start: its figures cover part of the run
    summary = summarize(records, duration)
    restarts = {k: v - restarts0[k] for k, v in c.restarts().items()}
    return {"scenario": name, "requests": len(records), "lost": sum(not r.ok for r in records),
            "p99_latency_ms": summary["e2e_p99_ms"], "recovery_s": recovery,
            "router_retries": router["retries"], "client_retries": client.retries,
            "estimated_hit_rate": None if restarts["router_restarts"] else router["estimated_hit_rate"],
            "measured_hit_rate": summary["cache_hit_rate"], "duration_s": duration, **restarts}


def _answers(url: str) -> bool:
    try:
        return http_json("GET", url + "/health", timeout=1)["healthy_workers"] > 0
    except OSError:
        return False


def table(rows: list[dict]) -> str:
    head = (f"| scenario | requests | lost | p99 latency (ms) | recovery time (s) | router retries | client retries | "
            f"restarts | est. / measured hit |\n|---|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [f"| {r['scenario']} | {r['requests']} | {r['lost']} | {r['p99_latency_ms']:,.0f} | "
             f"{r['recovery_s']:.2f} | {r['router_retries']} | {r['client_retries']} | "
             f"{r['worker_restarts'] + r['router_restarts']} | "
             f"{'n/a' if r['estimated_hit_rate'] is None else format(r['estimated_hit_rate'], '.3f')} / "
             f"{r['measured_hit_rate']:.3f} |" for r in rows]
    return "\n".join([head, *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, fewer requests")
    ap.add_argument("--port", type=int, default=31400, help="router port (workers and the proxy on the next ports)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    names = args.scenarios or (QUICK if args.quick else SCENARIOS)
    groups, turns = (8, 4) if args.quick else (16, 6)
    cfg = compose(["cluster.instances=4", f"router.port={args.port}", "router=cache_aware", "engine.kv_budget_mb=4",
                   "workload=shared_prefix", "workload.max_concurrency=16", "router.health_check_interval_secs=0.5",
                   "router.health_check_timeout_secs=1", f"router.request_timeout_s={SILENCE_S}",
                   "router.abort_timeout_s=1", "cluster.restart_backoff_s=0.2", "logger.mode=disabled"])
    t0 = time.time()
    rows = []
    with Cluster(cfg) as c:
        c.warm_up()
        proxy = Proxy(c.worker_urls[3], args.port + 5)
        try:
            for i, name in enumerate(names):
                swap = name in PROXY_FAULTS
                if swap:  # the router fronts worker 3 through the proxy for this scenario
                    http_json("POST", f"{c.router_url}/remove_worker?url={c.worker_urls[3]}", data=b"")
                    http_json("POST", f"{c.router_url}/add_worker?url={proxy.url}", data=b"")
                try:
                    rows.append(run_scenario(name, c, cfg, proxy, groups, turns, seed=i))
                finally:
                    if swap:
                        http_json("POST", f"{c.router_url}/remove_worker?url={proxy.url}", data=b"")
                        http_json("POST", f"{c.router_url}/add_worker?url={c.worker_urls[3]}", data=b"")
                r = rows[-1]
                print(f"  {name:<16} lost {r['lost']}/{r['requests']}  p99 {r['p99_latency_ms']:,.0f} ms  "
                      f"recovery {r['recovery_s']:.2f} s", flush=True)
        finally:
            proxy.close()
    print(table(rows))
    out = {"experiment": "chaos", "git_sha": git_sha(), "wall_s": time.time() - t0, "groups": groups, "turns": turns,
           "silence_timeout_s": SILENCE_S, "fault_window_s": FAULT_WINDOW_S, "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
