"""The router's callback path (framework/serving/router/flight.py) keeps every feature of the coroutine path: each test
sends non-streamed requests through the real router on its own server to real aiohttp workers on loopback, with the
coroutine path made to fail (``run_call`` raises), so that a request that left the callback path fails the test.
Raw sockets where the HTTP framing matters: pipelined requests on one connection, a body split across segments."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from framework.core.registry import ROUTING
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import start_router
from serving_helpers import serve, url_of, wait_until

pytestmark = pytest.mark.anyio
FAST = dict(health_check_interval_secs=0.05, retry_backoff_base_s=0.001, retry_backoff_max_s=0.01)


def worker(name: str, seen: list) -> web.Application:
    """A worker: answers /generate with its name and the request id it got, unless the prompt asks otherwise:
    ``drop <name>`` closes the connection unanswered on that worker, ``fail <name>`` is a 500 there, ``slow`` answers after 5 s, ``chunked`` answers
    without a Content-Length, ``client error`` is a 400."""
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["text"]
        seen.append((name, text, request.headers.get("X-Request-Id")))
        if text == f"drop {name}":
            request.transport.close()
            await asyncio.sleep(1)
        if text == "slow":
            await asyncio.sleep(5)
        if text == "client error":
            return web.json_response({"error": "no"}, status=400)
        if text == f"fail {name}":
            return web.json_response({"error": "broken"}, status=500)
        if text == "chunked":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"text": "in ')
            await resp.write(b'two"}')
            await resp.write_eof()
            return resp
        return web.json_response({"text": name, "rid": request.headers.get("X-Request-Id")})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return app


@asynccontextmanager
async def routed(policy=None, **cfg):
    """(router, an aiohttp session on it, what the workers saw, the router's port), two workers 'a' and 'b'."""
    seen: list = []
    workers = [await serve(worker(n, seen)) for n in ("a", "b")]
    server = await start_router(policy or ROUTING.get("round_robin")(), [url_of(w) for w in workers],
                                RouterServiceConfig(**{**FAST, **cfg}), port=0)

    async def no_coroutine_path(*args, **kw):
        raise AssertionError("a non-streamed request left the callback path")

    server.router.run_call = no_coroutine_path
    try:
        async with aiohttp.ClientSession(server.url) as http:
            yield server.router, http, seen, server.port
    finally:
        await server.cleanup()
        for w in workers:
            await w.close()


async def generate(http, text: str, **kw):
    async with http.post("/generate", json={"text": text}, **kw) as r:
        return r.status, r.headers, await r.read()


async def test_a_dropped_connection_or_a_500_is_retried_on_the_other_worker_and_counted():
    async with routed(max_concurrent_requests=4) as (router, http, seen, _):
        for _ in range(2):  # round robin: one of the two starts on 'a', which drops it
            status, headers, body = await generate(http, "drop a")
            assert status == 200 and json.loads(body)["text"] == "b"
            assert headers["X-Servelab-Worker"] == router.workers[headers["X-Servelab-Worker"]].url
        a = next(w for w in router.workers.values() if w.failures)
        assert a.failures == router.stats.retries >= 1  # the breaker saw each drop; each retry was counted
        for _ in range(2):  # a 500 is retried elsewhere too
            status, _, body = await generate(http, "fail a")
            assert status == 200 and json.loads(body)["text"] == "b"
        assert a.failures == router.stats.retries >= 2
        assert router.stats.outcomes["/generate", "ok"] == 4
        assert router.admission.in_flight == 0 and all(w.in_flight == 0 for w in router.workers.values())


async def test_the_deadline_ends_a_slow_answer_with_a_504_without_a_retry():
    async with routed(first_byte_timeout_s=0.3, max_concurrent_requests=4) as (router, http, seen, _):
        status, _, body = await generate(http, "slow")
        assert status == 504 and "router.first_byte_timeout_s=0.3" in json.loads(body)["error"]["message"]
        assert len(seen) == 1 and router.stats.retries == 0
        assert router.stats.outcomes["/generate", "timeout"] == 1 and router.admission.in_flight == 0
        assert not router._flights


async def test_admission_slots_and_worker_counts_come_back_on_every_exit():
    # no health check during the test: it would find the workers marked unhealthy below well again
    async with routed(max_concurrent_requests=2, queue_size=0, first_byte_timeout_s=0.3,
                      health_check_interval_secs=3600) as (router, http, _, _p):
        assert (await generate(http, "fine"))[0] == 200
        assert (await generate(http, "client error"))[0] == 400
        assert (await generate(http, "slow"))[0] == 504
        with pytest.raises(asyncio.TimeoutError):  # the client leaves while its worker is busy
            await generate(http, "slow", timeout=aiohttp.ClientTimeout(total=0.1))
        await wait_until(lambda: router.admission.in_flight == 0, what="the slot of the client that left")
        for w in list(router.workers.values()):  # no worker left: a 503
            w.healthy = False
        assert (await generate(http, "fine"))[0] == 503
        outcomes = {k[1]: n for k, n in router.stats.outcomes.items()}
        assert outcomes == {"ok": 1, "client_error": 1, "timeout": 1, "client_disconnect": 1, "no_worker": 1}
        assert all(w.in_flight == 0 for w in router.workers.values()) and not router._flights
        assert router.admission.stats()["admitted"] == 5 and router.admission.tokens == pytest.approx(2, abs=0.1)


async def test_request_ids_pass_through_or_are_made():
    async with routed() as (router, http, seen, _):
        status, headers, body = await generate(http, "mine", headers={"X-Request-Id": "client-id-1"})
        assert status == 200 and headers["X-Request-Id"] == "client-id-1" == json.loads(body)["rid"]
        status, headers, body = await generate(http, "theirs")
        made = headers["X-Request-Id"]
        assert len(made) == 32 and json.loads(body)["rid"] == made and seen[-1][2] == made


async def test_a_bad_body_is_a_400_json_error_counted_as_invalid():
    async with routed() as (router, http, seen, _):
        async with http.post("/generate", data=b'{"text": ', headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        assert not seen and router.stats.outcomes["/generate", "invalid_request"] == 1


async def test_an_answer_without_a_length_is_relayed_whole():
    async with routed() as (router, http, _, _p):
        status, headers, body = await generate(http, "chunked")
        assert status == 200 and json.loads(body) == {"text": "in two"}
        assert router.stats.outcomes["/generate", "ok"] == 1


async def test_pipelined_requests_and_a_body_in_pieces_on_one_connection():
    def request(text: str) -> bytes:
        body = json.dumps({"text": text}).encode()
        return b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async with routed() as (router, http, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("first") + request("slow-free second") + request("third"))  # one segment, three
        answers = [await read_answer(reader) for _ in range(3)]
        assert [s for s, _ in answers] == [200] * 3
        assert [json.loads(b)["text"] for _, b in answers] == ["a", "b", "a"]  # in order (round robin)
        whole = request("in pieces")
        for piece in (whole[:20], whole[20:-7], whole[-7:]):  # head and body split across segments
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)
        assert (await read_answer(reader))[0] == 200
        writer.close()


async def test_a_held_request_goes_when_the_events_let_it_go():
    rr = ROUTING.get("round_robin")

    class Holding(rr):
        holding = 30.0

        def hold_s(self, decision):
            return self.holding

    policy = Holding()
    async with routed(policy) as (router, http, seen, _):
        sent = asyncio.create_task(generate(http, "held"))
        await wait_until(lambda: router.core.held(), what="the request to be held")
        assert not seen
        policy.holding = 0.0  # the worker's events came: the core lets it go
        url = router.core.held()[0].worker.url
        router.events.on_release(router.core.worker_events(url, []))
        assert (await sent)[0] == 200 and router.stats.holds == 1 and not router.core.held()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return int(head.split(b" ")[1]), await reader.readexactly(length)
