"""The router service over real loopback HTTP: forwarding, streaming, retries, breaker, load accounting, membership.

Workers are real ``create_worker_app`` servers over real engines built from one seed (so any worker's greedy text is
the oracle's, serving_helpers.greedy), plus small aiohttp apps that fail on purpose (503, broken streams) and ports
where nothing listens.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest

from framework.core.registry import ROUTING
from framework.serving.http.chat_template import apply_chat_template
from framework.serving.router.service import start_router
from framework.serving.router.config import RouterServiceConfig
from framework.serving.worker import create_worker_app
from serving_helpers import (break_model, broken_stream_app, engine_client, engine_requests, engine_stats, free_port,
                             greedy_text, iter_sse, read_sse, serve, status_app, url_of, wait_until)

pytestmark = pytest.mark.anyio
FAST = dict(health_check_interval_secs=0.05, retry_backoff_base_s=0.001, retry_backoff_max_s=0.01)


@pytest.fixture(scope="module")
def engines():
    clients = [engine_client(), engine_client()]
    yield clients
    for c in clients:
        c.close()


@asynccontextmanager
async def router_over(urls, policy="round_robin", **cfg):
    """A router (its own loopback server) over ``urls``; yields (Router, client session on the router)."""
    server = await start_router(ROUTING.get(policy)(), urls, RouterServiceConfig(**{**FAST, **cfg}), port=0)
    try:
        async with aiohttp.ClientSession(server.url) as http:
            yield server.router, http
    finally:
        await server.cleanup()


@asynccontextmanager
async def workers_over(clients):
    """A worker server in front of each engine, which starts idle with an empty radix cache."""
    for c in clients:
        await wait_until(lambda: engine_requests(c) == 0, what="the engine to finish the previous test's requests")
        assert await c.flush_cache()
    servers = [await serve(create_worker_app(c, model_name="tiny")) for c in clients]
    try:
        yield servers, [url_of(s) for s in servers]
    finally:
        for s in servers:
            await s.close()


def assert_no_load(router):
    assert all(v == 0 for v in router.policy.loads.values()), router.policy.loads
    assert all(w.in_flight == 0 for w in router.workers.values())


def prefills(clients) -> list[int]:
    return [engine_stats(c)["extend_steps"] for c in clients]


async def gen(http, text, n=4, **extra):
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, **extra}
    async with http.post("/generate", json=body) as r:
        return r.status, await r.json(), r.headers.get("X-Servelab-Worker")


async def test_forwards_all_apis_round_robin_and_counts(engines):
    async with workers_over(engines) as (_, urls), router_over(urls) as (router, http):
        results = [await gen(http, f"prompt {i}") for i in range(4)]
        assert [w for _, _, w in results] == [urls[0], urls[1], urls[0], urls[1]]
        assert [out["text"] for _, out, _ in results] == [greedy_text(f"prompt {i}", 4) for i in range(4)]
        body = {"prompt": "abc", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        async with http.post("/v1/completions", json=body) as r:
            assert (await r.json())["choices"][0]["text"] == greedy_text("abc", 2)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        async with http.post("/v1/chat/completions", json=chat) as r:
            # the worker generated from exactly the templated text
            assert (await r.json())["choices"][0]["message"]["content"] == greedy_text("<|user|>hi\n<|assistant|>", 3)
        stats = await (await http.get("/router_stats")).json()
        assert stats["decisions"] == 6 and stats["per_worker_requests"] == {urls[0]: 3, urls[1]: 3}
        assert stats["retries"] == 0 and stats["outcomes"] == {"ok": 6}
        assert stats["router_decision_us"]["window"] == 6 and stats["router_decision_us"]["p50"] > 0
        metrics = await (await http.get("/metrics")).text()
        assert f'servelab_router_decisions_total{{reason="round_robin",worker="{urls[0]}"}} 3.0' in metrics
        assert 'servelab_router_requests_total{outcome="ok",route="/generate"} 4.0' in metrics
        assert "servelab_router_decision_latency_seconds_count 6.0" in metrics
        assert f'servelab_router_worker_in_flight{{worker="{urls[1]}"}} 0.0' in metrics
        assert f'servelab_router_worker_healthy{{worker="{urls[1]}"}} 1.0' in metrics
        assert "servelab_router_retries_total 0.0" in metrics
        assert_no_load(router)


async def test_stream_passes_through_incrementally(engines):
    async with workers_over(engines[:1]) as (_, urls), router_over(urls) as (router, http):
        n, events = 40, []
        req = {"text": "streaming", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
        async with http.post("/generate", json=req) as r:
            async for event in iter_sse(r):
                if not events:  # not buffered by the router: the first token arrives while the engine is still busy
                    assert engine_requests(engines[0]) == 1
                events.append(event)
        assert events[-1] == b"[DONE]" and len(events) == n + 1
        assert json.loads(events[-2])["text"] == greedy_text("streaming", n)
        assert_no_load(router)


async def test_retries_on_another_worker_when_one_dies(engines):
    async with workers_over(engines) as (servers, urls), \
            router_over(urls, health_check_interval_secs=60) as (router, http):
        before = prefills(engines)
        await servers[0].close()  # down, and no health check will notice for a minute
        results = [await gen(http, f"r{i}") for i in range(4)]
        assert all(status == 200 for status, _, _ in results)
        assert {worker for _, _, worker in results} == {urls[1]}
        assert router.stats.retries == 1  # the first request hit the dead worker, which was then marked unhealthy
        assert not router.workers[urls[0]].healthy and router.workers[urls[0]].failures == 1
        assert [a - b for a, b in zip(prefills(engines), before)] == [0, 4]
        assert_no_load(router)


async def test_500_is_retried_elsewhere_and_opens_the_breaker(engines):
    calls = []
    bad = await serve(status_app(500, calls=calls))
    async with workers_over(engines[:1]) as (_, urls), \
            router_over([url_of(bad), *urls], breaker_failure_threshold=2, breaker_cooldown_secs=2.5) as (router, http):
        results = [await gen(http, f"q{i}") for i in range(6)]
        assert all(status == 200 and worker == urls[0] for status, _, worker in results)
        assert len(calls) == 2 and router.workers[url_of(bad)].breaker.state == "open"  # no 3rd try while open
        # the six requests above must finish inside the cool-down (2.5 s: a loaded machine took over 1 s)
        await asyncio.sleep(2.55)  # cool-down over: the next request to it is a half-open probe
        for i in range(2):
            await gen(http, f"p{i}")
        assert len(calls) == 3 and router.workers[url_of(bad)].breaker.state == "open"
        assert router.stats.retries == 3
        assert_no_load(router)
    await bad.close()


async def test_503_is_busy_not_broken_and_its_retry_after_is_honoured(engines):
    calls = []
    # Retry-After 3 s: the four requests below must all come and go inside it, even on a loaded machine
    busy = await serve(status_app(503, calls=calls, headers={"Retry-After": "3"}))
    async with workers_over(engines[:1]) as (_, urls), \
            router_over([url_of(busy), *urls], breaker_failure_threshold=1) as (router, http):
        results = [await gen(http, f"q{i}") for i in range(4)]
        assert all(status == 200 and worker == urls[0] for status, _, worker in results)
        w = router.workers[url_of(busy)]
        assert len(calls) == 1 and router.stats.retries == 1  # then no new request while its Retry-After runs
        assert w.breaker.state == "closed" and w.failures == 0 and 0 < w.describe()["retry_after_s"] <= 3
        await wait_until(lambda: w.routable(time.monotonic()), timeout=4, what="the Retry-After to pass")
        await gen(http, "again")
        await gen(http, "and again")  # round robin: the busy worker's turn comes again
        assert len(calls) == 2
        assert_no_load(router)
    await busy.close()


async def test_retry_avoids_the_worker_that_failed_even_when_the_policy_prefers_it(engines):
    calls = []
    bad = await serve(status_app(503, calls=calls))
    async with workers_over(engines[:1]) as (_, urls), \
            router_over([url_of(bad), *urls], policy="cache_aware") as (router, http):
        # cache_aware sends a first request to the first of two empty workers, and its retry would match the text
        # it just inserted for that worker: only excluding the failed worker sends the retry elsewhere
        status, out, worker = await gen(http, "sticky text")
        assert status == 200 and worker == urls[0] and out["text"] == greedy_text("sticky text", 4)
        assert router.stats.retries == 1 and len(calls) == 1
        assert_no_load(router)
    await bad.close()


@pytest.mark.parametrize("status, sent", [(500, 1), (503, 3)])
async def test_a_lone_failing_worker_gives_back_its_error_after_bounded_retries(anyio_backend, status, sent):
    """With no other worker, a retry goes back to the one that failed only when it said it is busy (503): after a
    backoff, at most max_retries times. A retry is counted only when it is sent."""
    calls = []
    bad = await serve(status_app(status, calls=calls, headers={"X-Why": "stub"}))
    async with router_over([url_of(bad)], max_retries=2, breaker_failure_threshold=100) as (router, http):
        async with http.post("/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == status and (await r.json())["error"]["message"] == f"stub says {status}"
            assert r.headers["X-Why"] == "stub" and r.headers["X-Servelab-Worker"] == url_of(bad)
        assert len(calls) == sent and router.stats.retries == sent - 1
        assert len({c.headers["X-Request-Id"] for c in calls}) == 1  # one client request, one id on every try
        assert_no_load(router)
    await bad.close()


async def test_client_4xx_passes_through_and_does_not_count(engines):
    async with workers_over(engines) as (_, urls), router_over(urls, breaker_failure_threshold=1) as (router, http):
        before = prefills(engines)
        for _ in range(3):  # valid for routing, invalid for the worker
            async with http.post("/generate", json={"text": "a", "sampling_params": {"top_p": 5}}) as r:
                assert r.status == 400 and "sampling_params.top_p" in (await r.json())["error"]["message"]
        too_long = "x" * (engines[0].local_engine.capacity + 1)  # valid for the worker, rejected by the engine itself
        async with http.post("/generate", json={"text": too_long}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "text"
        async with http.post("/v1/chat/completions", json={"messages": "hi"}) as r:  # rejected by the router itself
            assert r.status == 400 and (await r.json())["error"]["message"].startswith("messages:")
        assert router.stats.retries == 0 and router.stats.outcomes["/generate", "client_error"] == 4
        assert router.stats.outcomes["/v1/chat/completions", "invalid_request"] == 1
        assert all(w.failures == 0 and w.breaker.state == "closed" for w in router.workers.values())
        assert sum(w.requests for w in router.workers.values()) == 4
        assert prefills(engines) == before  # no engine ran any of them
        assert (await gen(http, "fine"))[0] == 200
        assert_no_load(router)


async def test_router_errors_are_json(engines):
    async with workers_over(engines[:1]) as (_, urls), router_over(urls, client_max_size=1024) as (router, http):
        async with http.get("/missing") as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
        async with http.get("/v1/completions") as r:
            assert r.status == 405
        async with http.post("/generate", data=b"x" * 2048) as r:
            assert r.status == 413 and "1024 bytes" in (await r.json())["error"]["message"]
        async with http.post("/generate", data=b"{oops") as r:
            assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
        async with http.post("/add_worker") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "url"
        async with http.post("/add_worker", params={"url": "ftp://x"}) as r:
            assert r.status == 400
        async with http.post("/add_worker", params={"url": urls[0]}) as r:
            assert r.status == 409
        async with http.post("/remove_worker", params={"url": "http://127.0.0.1:1"}) as r:
            assert r.status == 404
        assert (await gen(http, "ok"))[0] == 200


async def test_load_is_released_on_disconnect_and_broken_stream(engines):
    broken = await serve(broken_stream_app())
    engine = engines[0]
    async with workers_over([engine]) as (_, urls), router_over(urls) as (router, http):
        n = 700
        req = {"text": "go on", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
        for stream in (True, False):
            decodes = engine_stats(engine)["decode_steps"]
            if stream:
                async with http.post("/generate", json=req) as r:
                    await r.content.readany()  # first chunk, then the client hangs up
            else:  # non-streaming: the client gives up while waiting for the whole answer
                pending = asyncio.create_task(http.post("/generate", json={**req, "stream": False}))
                await wait_until(lambda: engine_requests(engine) == 1, what="the request to reach the engine")
                pending.cancel()
            await wait_until(lambda: engine_requests(engine) == 0, what="the worker's engine to abort the request")
            assert engine_stats(engine)["decode_steps"] - decodes < n - 1  # cut short, not run to the end
            await wait_until(lambda: router.policy.loads[urls[0]] == 0, what="the router to release the load")
        assert_no_load(router)
        async with http.post("/add_worker", params={"url": url_of(broken)}) as r:
            assert r.status == 200
        async with http.post("/remove_worker", params={"url": urls[0]}) as r:
            assert r.status == 200
        async with http.post("/generate", json=req) as r:
            events = await read_sse(r)
        assert json.loads(events[0]) == {"text": "0"} and "broke the stream" in json.loads(events[-1])["error"]["message"]
        assert router.workers[url_of(broken)].failures == 1
        assert router.stats.outcomes["/generate", "broken_stream"] == 1
        assert router.stats.outcomes["/generate", "client_disconnect"] == 2
        # the estimate counts the streaming client that hung up (its worker had answered and prefilled the text), not
        # the one that left before any answer, nor the broken stream (its client retries elsewhere)
        assert router.stats.request_chars == len("go on")
        assert_no_load(router)
    await broken.close()


@pytest.mark.long
async def test_add_and_remove_under_load_drains(engines):
    async with workers_over(engines) as (_, urls), router_over(urls[:1]) as (router, http):
        n = 100  # ~1 s of decoding on this CPU: long enough to still be running when worker 0 is removed

        async def one(i):
            return await gen(http, f"load {i}", n=n)

        first = [asyncio.create_task(one(i)) for i in range(10)]
        await wait_until(lambda: engine_requests(engines[0]) == 10, what="10 requests in worker 0's engine")
        assert router.policy.loads[urls[0]] == 10
        assert f'servelab_router_worker_in_flight{{worker="{urls[0]}"}} 10.0' in await (await http.get("/metrics")).text()
        async with http.post("/add_worker", params={"url": urls[1]}) as r:
            assert (await r.json())["healthy"] is True
        second = [asyncio.create_task(one(i)) for i in range(10, 14)]
        await wait_until(lambda: engine_requests(engines[1]) > 0, what="the new worker to get traffic")
        async with http.post("/remove_worker", params={"url": urls[0]}) as r:
            removed = await r.json()
        assert removed["removed"] == urls[0] and removed["drained_requests"] >= 10 and removed["abandoned_requests"] == 0
        assert engine_requests(engines[0]) == 0  # it answered only once worker 0 had finished all it was given
        results = await asyncio.gather(*first, *second)
        assert all(status == 200 and out["meta_info"]["completion_tokens"] == n and
                   out["meta_info"]["finish_reason"]["type"] == "length" for status, out, _ in results)  # none lost
        after = [(await gen(http, f"after {i}"))[2] for i in range(3)]
        assert after == [urls[1]] * 3
        listed = await (await http.get("/list_workers")).json()
        assert listed["urls"] == [urls[1]] and list(router.policy.loads) == [urls[1]]
        assert_no_load(router)


async def test_startup_with_a_worker_not_up_yet(engines):
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    late_engine = engine_client()
    async with workers_over(engines[:1]) as (_, urls), router_over([late_url, *urls]) as (router, http):
        health = await (await http.get("/health")).json()
        assert health == {"status": "ok", "workers": 2, "healthy_workers": 1}
        assert {(await gen(http, f"early {i}"))[2] for i in range(3)} == {urls[0]}
        late = await serve(create_worker_app(late_engine, model_name="tiny"), port=late_port)
        await wait_until(lambda: router.workers[late_url].healthy, what="the late worker to pass a health check")
        served = [await gen(http, f"late {i}") for i in range(4)]
        assert {w for _, _, w in served} == {urls[0], late_url}
        assert all(out["text"] == greedy_text(f"late {i}", 4) for i, (_, out, _) in enumerate(served))
        info = await (await http.get("/get_server_info")).json()
        assert info["router"]["healthy_workers"] == 2
        assert engine_stats(late_engine)["extend_steps"] == sum(w == late_url for _, _, w in served)
        assert info["workers"][late_url]["extend_steps"] == engine_stats(late_engine)["extend_steps"]
        assert info["totals"]["kv_capacity_tokens_instance"] == late_engine.local_engine.capacity + engines[0].local_engine.capacity
        models = await (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        async with http.post("/flush_cache") as r:
            assert r.status == 200 and sorted((await r.json())["workers"]) == sorted([late_url, urls[0]])
        assert late_engine.local_engine.scheduler.cache.total_size() == engines[0].local_engine.scheduler.cache.total_size() == 0
        await late.close()
        await wait_until(lambda: not router.workers[late_url].healthy, what="the health check to drop it")
        assert (await gen(http, "still fine"))[2] == urls[0]
    late_engine.close()


async def test_a_worker_whose_engine_died_is_skipped(engines):
    doomed, restarted = engine_client(), engine_client()
    port = free_port()
    dead = await serve(create_worker_app(doomed, model_name="tiny"), port=port)
    async with workers_over(engines[:1]) as (_, urls), router_over([url_of(dead), *urls]) as (router, http):
        break_model(doomed)
        async with aiohttp.ClientSession(url_of(dead)) as direct:
            async with direct.post("/generate", json={"text": "boom"}) as r:  # the engine crashes on this step
                assert r.status == 500 and doomed.error is not None
            async with direct.get("/health") as r:
                assert r.status == 503 and (await r.json())["error"] == doomed.error
        await wait_until(lambda: not router.workers[url_of(dead)].healthy, what="the health check to mark it down")
        assert router.workers[url_of(dead)].last_health_error == "/health answered 503"
        assert {(await gen(http, f"r{i}"))[2] for i in range(4)} == {urls[0]}
        await dead.close()  # restarted on the same port with a fresh engine: the router takes it back
        back = await serve(create_worker_app(restarted, model_name="tiny"), port=port)
        await wait_until(lambda: router.workers[url_of(back)].healthy, what="the restarted worker to come back")
        assert (await gen(http, "again"))[1]["text"] == greedy_text("again", 4)
        await back.close()
    doomed.close()
    restarted.close()


async def test_cache_aware_policy_drives_the_router(engines):
    async with workers_over(engines) as (_, urls), router_over(urls, policy="cache_aware") as (router, http):
        prefix = "a long shared system prompt " * 4
        served = [await gen(http, prefix + f"question {i}") for i in range(5)]
        assert len({w for _, _, w in served}) == 1  # after the first request, the prefix match keeps the group together
        assert all(out["meta_info"]["cached_tokens"] >= len(prefix) for _, out, _ in served[1:])  # real cache hits
        stats = await (await http.get("/router_stats")).json()
        assert stats["reasons"].get("cache_hit") == 4 and stats["estimated_hit_rate"] > 0.5
        assert_no_load(router)
