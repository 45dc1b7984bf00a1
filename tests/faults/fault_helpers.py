"""Helpers for the fault-injection suite: an aiohttp app served from a thread (a FaultProxy beside a real cluster),
a workload whose router cache estimate is exact when nothing fails, and a load run in the background."""
from __future__ import annotations

import asyncio
import random
import threading
import time

from aiohttp import web

from framework.cluster.cluster import http_json
from framework.contracts.workload import Session, Turn, random_text
from framework.load.http_client import LoadClient


class BackgroundApp:
    """``app`` on a loopback port (given, or port 0: the kernel's choice, read back), served by an event loop in a
    daemon thread."""

    def __init__(self, app: web.Application, port: int | None = None):
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, handler_cancellation=True)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", port or 0).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def grouped_sessions(groups: int, turns: int, seed: int, prefix_chars: int = 256, question_chars: int = 24,
                     output_len: int = 8) -> list[Session]:
    """One session per group: a prefix of its own, then ``turns`` questions one after the other. Two requests with
    the same prefix are never in flight at once, so whatever the router credits a worker with is in that worker's
    cache by the time the next request of the group arrives: the router's estimate is exact when nothing fails."""
    rng = random.Random(seed)
    return [Session(f"group-{g}", 0.0, [Turn(random_text(rng, question_chars), output_len) for _ in range(turns)],
                    prefix=random_text(rng, prefix_chars) + "\n", carry_history=False) for g in range(groups)]


class BackgroundLoad:
    """``client.play(sessions)`` in a thread; ``records`` grow as requests finish."""

    def __init__(self, client: LoadClient, sessions: list[Session]):
        self.client, self.out = client, {}
        self.thread = threading.Thread(target=lambda: self.out.update(result=client.play(sessions)))
        self.thread.start()

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.client.records) < n:
            assert time.monotonic() < deadline, f"only {len(self.client.records)} of {n} requests finished"
            time.sleep(0.01)

    def result(self, timeout: float = 120):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the load did not finish"
        return self.out["result"]


def wait_for(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def listed(router_url: str) -> dict:
    return http_json("GET", router_url + "/list_workers")


def routable(router_url: str, url: str) -> bool:
    return any(w["url"] == url and w["healthy"] and not w["draining"] for w in listed(router_url)["workers"])
