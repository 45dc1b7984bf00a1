"""The router under 10x its admitted capacity, on loopback: 80 clients keep sending to a router that admits 8 at a
time (two stub workers, 50 ms per answer) with a queue of 16 that waits 0.5 s at most. Every request is answered
(200, or 429 / 408 with Retry-After) within the queue timeout plus its service time, never held longer; the queue never
exceeds its bound; the process's memory stays flat; and every admitted request reaches a worker and comes back
whole: the workers' count, the router's admitted count and the clients' 200s agree."""
from __future__ import annotations

import asyncio
import resource
import time

import aiohttp
import pytest
from aiohttp import web

from framework.core.registry import ROUTING
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import start_router
from serving_helpers import serve, url_of

pytestmark = [pytest.mark.anyio, pytest.mark.long]
SERVICE_S, CAPACITY, CLIENTS, QUEUE, QUEUE_TIMEOUT_S, LOAD_S = 0.05, 8, 80, 16, 0.5, 4.0
SLACK_S = 1.0  # a loaded 2-core machine's scheduling delays


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def test_ten_times_capacity_is_refused_quickly_and_nothing_admitted_is_lost():
    served = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(SERVICE_S)
        served.append(body["text"])
        return web.json_response({"text": body["text"] + " done"})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    workers = [await serve(app), await serve(app)]
    server = await start_router(ROUTING.get("round_robin")(), [url_of(w) for w in workers], RouterServiceConfig(
        health_check_interval_secs=1.0, max_concurrent_requests=CAPACITY, queue_size=QUEUE,
        queue_timeout_secs=QUEUE_TIMEOUT_S), port=0)
    router, answers, peak_queue = server.router, [], [0]

    async def sample() -> None:
        while True:
            peak_queue[0] = max(peak_queue[0], len(router.admission.waiting))
            await asyncio.sleep(0.005)

    async def client(http: aiohttp.ClientSession, c: int, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            text, t0 = f"c{c}-{i}", time.monotonic()
            async with http.post("/generate", json={"text": text}) as r:
                body = await r.json()
                answers.append((r.status, time.monotonic() - t0, text, body, r.headers.get("Retry-After")))
            i += 1

    sampler = asyncio.create_task(sample())
    try:
        async with aiohttp.ClientSession(server.url, connector=aiohttp.TCPConnector(limit=0)) as http:
            await asyncio.gather(*(client(http, c, time.monotonic() + 0.3) for c in range(CLIENTS)))  # warm-up
            answers.clear()
            served.clear()
            before = router.admission.stats()
            rss0 = rss_mb()
            await asyncio.gather(*(client(http, c, time.monotonic() + LOAD_S) for c in range(CLIENTS)))
            rss1 = rss_mb()
    finally:
        sampler.cancel()
        await server.cleanup()
        for w in workers:
            await w.close()
    after = router.admission.stats()
    by_status: dict[int, list] = {}
    for a in answers:
        by_status.setdefault(a[0], []).append(a)
    ok = by_status.get(200, [])
    refused = by_status.get(429, []) + by_status.get(408, [])
    print(f"\n{len(answers)} answers in {LOAD_S:g}s: {len(ok)} admitted (200), {len(by_status.get(429, []))} 429, "
          f"{len(by_status.get(408, []))} 408; slowest 200 {max(a[1] for a in ok):.3f}s, slowest refusal "
          f"{max(a[1] for a in refused):.3f}s; queue peak {peak_queue[0]} of {QUEUE}; RSS {rss0:.1f} -> {rss1:.1f} MB")
    assert set(by_status) <= {200, 408, 429}, sorted(by_status)
    assert ok and refused and len(refused) > len(ok)  # overloaded: most are refused, at once or after the wait
    assert all(a[4] for a in refused) and all(a[3]["error"]["type"] == "rate_limit_error" for a in refused)
    assert max(a[1] for a in answers) < QUEUE_TIMEOUT_S + SERVICE_S + SLACK_S  # nothing is held longer
    assert peak_queue[0] <= QUEUE
    assert all(a[3] == {"text": a[2] + " done"} for a in ok)  # whole answers, to the right client
    assert sorted(served) == sorted(a[2] for a in ok)  # every admitted request reached a worker, none other did
    assert after["admitted"] - before["admitted"] == len(ok) and after["in_flight"] == 0
    assert rss1 - rss0 < 64, (rss0, rss1)
