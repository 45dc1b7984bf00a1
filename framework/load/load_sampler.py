"""Per-worker load over time, sampled from a router's Prometheus `/metrics` while a bench runs.

Routers name the series differently: servelab's router exports `servelab_router_worker_in_flight{worker=...}`,
SGLang's (sglang-router 0.3.x, "smg") `smg_worker_requests_active{worker=...}`; both count the requests the router
has in flight on each worker. A source that exports neither (a single server) gives an empty timeline.
"""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp

IN_FLIGHT_SERIES = ("servelab_router_worker_in_flight", "smg_worker_requests_active")
_LINE = re.compile(r'^(\w+)\{[^}]*?worker="([^"]+)"[^}]*\}\s+(\S+)')


def parse_in_flight(text: str) -> dict[str, float]:
    """worker -> requests in flight, from a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in IN_FLIGHT_SERIES:
            out[m.group(2)] = float(m.group(3))
    return out


class LoadSampler:
    """Polls `url` every `interval_s` until stopped; `timeline()` is {"t_s": [...], "in_flight": {worker: [...]}}
    with times relative to `start` (perf_counter), a worker absent from a sample counted as 0."""

    def __init__(self, url: str, interval_s: float, start: float):
        self.url, self.interval_s, self.start = url, interval_s, start
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.error: str | None = None

    async def run(self, http: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.interval_s))
        while True:
            try:
                async with http.get(self.url, timeout=timeout) as resp:
                    text = await resp.text() if resp.status == 200 else ""
                self.samples.append((time.perf_counter() - self.start, parse_in_flight(text)))
            except (aiohttp.ClientError, TimeoutError) as e:
                self.error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(self.interval_s)

    def timeline(self) -> dict:
        workers = sorted({w for _, s in self.samples for w in s})
        if not workers:
            return {}
        return {"source": self.url, "t_s": [t for t, _ in self.samples],
                "in_flight": {w: [s.get(w, 0.0) for _, s in self.samples] for w in workers}}
