"""The router's ``request_timeout_s``: a worker silent that long is given up on (health.SilenceTimeout, one periodic
sweep instead of aiohttp's per-request sock_read timer), while slow-but-talking streams and client disconnects are
left alone. Stub workers only; no engine."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from framework.registry import ROUTING
from framework.serving.router import ROUTER_KEY, RouterServiceConfig, create_router_app
from serving_helpers import read_sse, serve, url_of, wait_until

pytestmark = pytest.mark.anyio
TIMEOUT_S = 0.3


def stub(behaviour: str) -> web.Application:
    """A worker that answers /generate as told: ``ok``, ``silent`` (never a head), ``stall`` (one SSE chunk, then
    silence), ``slow`` (six SSE chunks, one every TIMEOUT_S / 3)."""
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        if behaviour == "ok":
            return web.json_response({"text": "ok"})
        if behaviour == "silent":
            await asyncio.sleep(60)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(6):
            await resp.write(f'data: {{"text": "{i}"}}\n\n'.encode())
            await asyncio.sleep(60 if behaviour == "stall" else TIMEOUT_S / 3)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return app


@asynccontextmanager
async def router_over(*behaviours: str):
    workers = [await serve(stub(b)) for b in behaviours]
    cfg = RouterServiceConfig(request_timeout_s=TIMEOUT_S, health_check_interval_secs=0.05,
                              retry_backoff_base_s=0.001, retry_backoff_max_s=0.01)
    app = create_router_app(ROUTING.get("round_robin")(), [url_of(w) for w in workers], cfg)
    server = await serve(app)
    router = app[ROUTER_KEY]
    try:
        async with aiohttp.ClientSession(url_of(server)) as http:
            yield router, http, [url_of(w) for w in workers]
    finally:
        await server.close()
        for w in workers:
            await w.close()
    assert all(n == 0 for n in router.policy.loads.values()), router.policy.loads
    assert not router._silence._waiting and not router._silence._expired


async def test_a_silent_worker_is_given_up_on_and_retried_elsewhere():
    async with router_over("silent", "ok") as (router, http, urls):
        async with http.post("/generate", json={"text": "hi"}) as r:  # round robin: the silent worker first
            assert r.status == 200 and await r.json() == {"text": "ok"}
            assert r.headers["X-Servelab-Worker"] == urls[1]
        assert router.workers[urls[0]].failures == 1 and router.stats.retries == 1


async def test_only_silent_workers_give_a_504_naming_the_setting():
    async with router_over("silent") as (router, http, _):
        async with http.post("/generate", json={"text": "hi"}) as r:
            assert r.status == 504 and "request_timeout_s" in (await r.json())["error"]["message"]


async def test_a_stream_that_stalls_ends_with_an_error_event():
    async with router_over("stall") as (router, http, _):
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:
            events = await read_sse(r)
        assert json.loads(events[0]) == {"text": "0"} and "silent" in json.loads(events[-1])["error"]["message"]
        assert router.stats.outcomes["/generate", "broken_stream"] == 1


async def test_a_slow_stream_that_keeps_talking_is_not_cut():
    async with router_over("slow") as (router, http, _):  # 6 chunks over 2 x TIMEOUT_S, none TIMEOUT_S apart
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:
            events = await read_sse(r)
        assert [json.loads(e) for e in events] == [{"text": str(i)} for i in range(6)]
        assert router.stats.outcomes["/generate", "ok"] == 1


async def test_a_client_leaving_a_silent_worker_is_a_disconnect_not_a_timeout():
    async with router_over("silent") as (router, http, urls):
        pending = asyncio.create_task(http.post("/generate", json={"text": "hi"}))
        await wait_until(lambda: router.workers[urls[0]].in_flight == 1, what="the request to reach the worker")
        pending.cancel()
        await wait_until(lambda: router.stats.outcomes["/generate", "client_disconnect"] == 1,
                         what="the router to see the client leave")
        await asyncio.sleep(2 * TIMEOUT_S)  # past the timeout: nothing left to time out
        assert router.workers[urls[0]].failures == 0 and router.stats.retries == 0
