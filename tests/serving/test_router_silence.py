"""The router's waits on a worker: ``request_timeout_s`` (a streaming worker silent that long), and the client
request's first-byte and total deadlines (health.WaitTimer, one periodic sweep instead of a timer per request). A silent
worker's request goes elsewhere only once the worker confirms it dropped it (``/abort_request``); a hung one, or a
deadline, ends in a 504; slow-but-talking streams and client disconnects are left alone. Stub workers only."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from framework.core.registry import ROUTING
from framework.serving.router.service import start_router
from framework.serving.router.config import RouterServiceConfig
from serving_helpers import read_sse, serve, url_of, wait_until

pytestmark = pytest.mark.anyio
TIMEOUT_S = 0.3


class Stub:
    """A worker that answers /generate as told: ``ok``, ``silent`` (never a head; its /abort_request cancels the
    request and says so), ``hung`` (never a head, and /abort_request never answers either), ``late`` (the whole
    answer after 3 x TIMEOUT_S), ``stall`` (one SSE chunk, then silence), ``slow`` (six SSE chunks, one every
    TIMEOUT_S / 3)."""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour
        self.requests: list[str] = []  # X-Request-Id of each /generate it got
        self.aborts: list[str] = []  # ... of each /abort_request
        self.running: dict[str, asyncio.Task] = {}
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_post("/abort_request", self.abort)
        self.app.router.add_get("/health", self.health)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        rid = request.headers["X-Request-Id"]
        self.requests.append(rid)
        self.running[rid] = asyncio.current_task()
        try:
            if self.behaviour == "ok":
                return web.json_response({"text": "ok"})
            if self.behaviour in ("silent", "hung"):
                await asyncio.sleep(60)
            if self.behaviour == "late":
                await asyncio.sleep(3 * TIMEOUT_S)
                return web.json_response({"text": "late"})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(6):
                await resp.write(f'data: {{"text": "{i}"}}\n\n'.encode())
                await asyncio.sleep(60 if self.behaviour == "stall" else TIMEOUT_S / 3)
            await resp.write_eof()
            return resp
        finally:
            del self.running[rid]

    async def abort(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        self.aborts.append(rid)
        if self.behaviour == "hung":
            await asyncio.sleep(60)
        task = self.running.get(rid)  # (gone already when the router's hang-up cancelled it)
        if task is not None:
            task.cancel()
        return web.json_response({"success": True, "aborted": int(task is not None)})


@asynccontextmanager
async def router_over(*behaviours: str, **cfg):
    stubs = [Stub(b) for b in behaviours]
    workers = [await serve(s.app) for s in stubs]
    cfg = RouterServiceConfig(**{**dict(request_timeout_s=TIMEOUT_S, health_check_interval_secs=0.05,
                                        retry_backoff_base_s=0.001, retry_backoff_max_s=0.01,
                                        abort_timeout_s=TIMEOUT_S), **cfg})
    server = await start_router(ROUTING.get("round_robin")(), [url_of(w) for w in workers], cfg, port=0)
    router = server.router
    try:
        async with aiohttp.ClientSession(server.url) as http:
            yield router, http, stubs, [url_of(w) for w in workers]
    finally:
        await server.cleanup()
        for w in workers:
            await w.close()
    assert all(n == 0 for n in router.policy.loads.values()), router.policy.loads
    assert not router._timer._waiting and not router._timer._expired


async def test_a_silent_worker_that_confirms_the_abort_is_retried_elsewhere():
    async with router_over("silent", "ok") as (router, http, stubs, urls):
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:  # round robin: silent first
            assert r.status == 200 and await r.json() == {"text": "ok"}
            assert r.headers["X-Servelab-Worker"] == urls[1]
        assert stubs[0].aborts == stubs[0].requests == stubs[1].requests  # one id, aborted where it went first
        assert stubs[0].running == {}
        assert router.workers[urls[0]].failures == 0 and router.workers[urls[0]].breaker.state == "closed"
        assert router.stats.retries == 1


async def test_a_hung_worker_is_not_doubled_a_504_names_the_setting():
    async with router_over("hung", "ok") as (router, http, stubs, urls):
        async with http.post("/generate", json={"text": "hi", "stream": True}, headers={"X-Request-Id": "mine"}) as r:
            error = (await r.json())["error"]["message"]
            assert r.status == 504 and r.headers["X-Servelab-Worker"] == urls[0]
        assert "router.request_timeout_s" in error and "did not confirm" in error
        assert stubs[0].requests == stubs[0].aborts == ["mine"] and stubs[1].requests == []  # not generated twice
        assert router.stats.retries == 0 and router.stats.outcomes["/generate", "timeout"] == 1
        assert router.workers[urls[0]].failures == 0


async def test_a_non_streaming_answer_is_not_cut_by_the_silence_timeout():
    async with router_over("late") as (router, http, stubs, urls):  # whole answer after 3 x request_timeout_s
        async with http.post("/generate", json={"text": "hi"}) as r:
            assert r.status == 200 and await r.json() == {"text": "late"} and router.stats.retries == 0


async def test_the_first_byte_deadline_ends_a_request_without_a_retry():
    async with router_over("late", "ok", request_timeout_s=60, first_byte_timeout_s=TIMEOUT_S) as (
            router, http, stubs, urls):
        async with http.post("/generate", json={"text": "hi"}) as r:
            assert r.status == 504 and "router.first_byte_timeout_s=0.3" in (await r.json())["error"]["message"]
        assert len(stubs[0].requests) == 1 and stubs[1].requests == [] and router.stats.retries == 0


async def test_the_total_deadline_cuts_a_stream_that_keeps_talking():
    async with router_over("slow", request_timeout_s=60, total_timeout_s=TIMEOUT_S) as (router, http, _, _):
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:
            events = await read_sse(r)
        assert json.loads(events[0]) == {"text": "0"} and len(events) < 6
        assert "router.total_timeout_s=0.3" in json.loads(events[-1])["error"]["message"]
        assert router.stats.outcomes["/generate", "broken_stream"] == 1


async def test_a_stream_that_stalls_ends_with_an_error_event():
    async with router_over("stall") as (router, http, _, _):
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:
            events = await read_sse(r)
        assert json.loads(events[0]) == {"text": "0"} and "silent" in json.loads(events[-1])["error"]["message"]
        assert router.stats.outcomes["/generate", "broken_stream"] == 1


async def test_a_slow_stream_that_keeps_talking_is_not_cut():
    async with router_over("slow") as (router, http, _, _):  # 6 chunks over 2 x TIMEOUT_S, none TIMEOUT_S apart
        async with http.post("/generate", json={"text": "hi", "stream": True}) as r:
            events = await read_sse(r)
        assert [json.loads(e) for e in events] == [{"text": str(i)} for i in range(6)]
        assert router.stats.outcomes["/generate", "ok"] == 1


async def test_a_client_leaving_a_silent_worker_is_a_disconnect_not_a_timeout():
    async with router_over("silent") as (router, http, stubs, urls):
        pending = asyncio.create_task(http.post("/generate", json={"text": "hi", "stream": True}))
        await wait_until(lambda: router.workers[urls[0]].in_flight == 1, what="the request to reach the worker")
        pending.cancel()
        await wait_until(lambda: router.stats.outcomes["/generate", "client_disconnect"] == 1,
                         what="the router to see the client leave")
        await asyncio.sleep(2 * TIMEOUT_S)  # past the timeout: nothing left to time out
        assert router.workers[urls[0]].failures == 0 and router.stats.retries == 0 and stubs[0].aborts == []
