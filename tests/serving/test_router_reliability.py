"""The router's bookkeeping under failures, with stub workers on loopback: headers both ways, retries counted when
sent, loads released on the worker state they were taken on, the cache estimate taken back or dropped when the
worker never got (or lost) the text, and remove/add racing in-flight requests."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from framework.core.registry import ROUTING
from framework.serving.router.service import start_router
from framework.serving.router.config import RouterServiceConfig
from serving_helpers import free_port, serve, status_app, url_of, wait_until

pytestmark = pytest.mark.anyio
FAST = dict(health_check_interval_secs=60, retry_backoff_base_s=0.001, retry_backoff_max_s=0.01)


class Held:
    """A worker that answers a /generate request only once its text is released (``release(text)``; every text
    with ``release_all``)."""

    def __init__(self):
        self.gates: dict[str, asyncio.Event] = {}
        self.released_all = False
        self.seen: list[web.Request] = []
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get("/health", self.health)

    def release(self, text: str) -> None:
        self.gates.setdefault(text, asyncio.Event()).set()

    def release_all(self) -> None:
        self.released_all = True
        for gate in self.gates.values():
            gate.set()

    async def generate(self, request: web.Request) -> web.Response:
        self.seen.append(request)
        gate = self.gates.setdefault((await request.json())["text"], asyncio.Event())
        if not self.released_all:
            await gate.wait()
        return web.json_response({"text": "done"}, headers={"X-From-Worker": "yes", "Connection": "keep-alive"})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


@asynccontextmanager
async def router_over(urls, policy="round_robin", **cfg):
    server = await start_router(ROUTING.get(policy)(), urls, RouterServiceConfig(**{**FAST, **cfg}), port=0)
    try:
        async with aiohttp.ClientSession(server.url) as http:
            yield server.router, http
    finally:
        await server.cleanup()


async def test_headers_pass_through_both_ways_without_hop_by_hop_ones():
    held = Held()
    held.release_all()
    worker = await serve(held.app)
    async with router_over([url_of(worker)]) as (router, http):
        headers = {"Authorization": "Bearer t", "X-Custom": "1", "Connection": "keep-alive, X-Secret",
                   "X-Secret": "hop", "Keep-Alive": "timeout=5", "User-Agent": "probe/1"}
        async with http.post("/generate", json={"text": "hi"}, headers=headers) as r:
            assert r.status == 200 and r.headers["X-From-Worker"] == "yes"
            assert r.headers["X-Servelab-Worker"] == url_of(worker)
        got = held.seen[0].headers
        assert got["Authorization"] == "Bearer t" and got["X-Custom"] == "1" and got["User-Agent"] == "probe/1"
        assert "X-Secret" not in got and "Keep-Alive" not in got  # hop-by-hop, and what Connection names
        assert len(got["X-Request-Id"]) == 32  # given one, for /abort_request
        async with http.post("/generate", json={"text": "hi"}, headers={"X-Request-Id": "mine"}) as r:
            assert r.status == 200 and held.seen[1].headers["X-Request-Id"] == "mine"
    await worker.close()


async def test_no_retry_is_counted_when_no_worker_is_left_to_try():
    """A dead worker (connection refused) and none other: one attempt, no retry counted, a 502 naming it."""
    dead = await serve(status_app(200))
    url = url_of(dead)
    async with router_over([url], max_retries=3) as (router, http):
        await dead.close()
        async with http.post("/generate", json={"text": "x"}) as r:
            body = await r.json()
            assert r.status == 502 and r.headers["X-Servelab-Worker"] == url
        assert body["error"]["message"].startswith("1 attempt(s) failed; last: " + url)
        assert router.stats.retries == 0 and router.workers[url].unreachable
        async with http.post("/generate", json={"text": "x"}) as r:  # now known down: the router says so itself
            assert r.status == 503 and router.stats.outcomes["/generate", "no_worker"] == 1


async def test_a_url_added_again_is_a_new_worker_to_the_load_counts():
    held = Held()
    worker = await serve(held.app)
    url = url_of(worker)
    async with router_over([url], drain_timeout_secs=0.1) as (router, http):
        first = asyncio.create_task(http.post("/generate", json={"text": "old"}))
        await wait_until(lambda: len(held.seen) == 1, what="the first request to arrive")
        removed = await (await http.post("/remove_worker", params={"url": url})).json()
        assert removed == {"removed": url, "drained_requests": 1, "abandoned_requests": 1}
        assert (await http.post("/add_worker", params={"url": url})).status == 200
        second = asyncio.create_task(http.post("/generate", json={"text": "new"}))
        await wait_until(lambda: len(held.seen) == 2, what="the second request to arrive")
        held.release("old")
        assert (await first).status == 200  # the abandoned request still finished...
        assert router.policy.loads[url] == 1 and router.workers[url].in_flight == 1  # ...releasing nothing new
        held.release("new")
        assert (await second).status == 200 and router.policy.loads[url] == 0
        assert router.workers[url].in_flight == 0
    await worker.close()


async def test_a_failed_attempt_takes_back_its_cache_credit_and_flush_drops_the_rest():
    bad, good = await serve(status_app(500)), await serve(status_app(200, body={"text": "ok"}))
    async with router_over([url_of(bad), url_of(good)], policy="cache_aware") as (router, http):
        tree = router.policy.tree
        async with http.post("/generate", json={"text": "a prompt long enough to matter"}) as r:
            assert r.status == 200 and r.headers["X-Servelab-Worker"] == url_of(good)
        assert tree.tenant_size(url_of(bad)) == 0  # it was chosen first, failed, and lost the credit
        assert tree.tenant_size(url_of(good)) == len("a prompt long enough to matter")
        stats = await (await http.get("/router_stats")).json()
        assert stats["request_chars"] == len("a prompt long enough to matter")  # the served attempt only
        router.policy.reset_worker(url_of(good))
        assert tree.tenant_size(url_of(good)) == 0 and tree.node_count == 0
    await bad.close()
    await good.close()


async def test_flush_cache_drops_the_estimate_of_every_worker_that_flushed():
    async def ok(request):
        return web.json_response({"text": "ok"})

    async def flushed(request):
        return web.json_response({"success": True})

    async def health(request):
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", ok)
    app.router.add_post("/flush_cache", flushed)
    app.router.add_get("/health", health)
    workers = [await serve(app), await serve(status_app(200, body={"text": "ok"}))]  # the second cannot flush
    async with router_over([url_of(w) for w in workers], policy="cache_aware") as (router, http):
        for text in ("first prompt", "other prompt"):  # a miss each: one per worker (smallest tree)
            await (await http.post("/generate", json={"text": text})).read()
        assert all(router.policy.tree.tenant_size(url_of(w)) > 0 for w in workers)
        async with http.post("/flush_cache") as r:
            assert r.status == 502  # the second one failed to flush...
        assert router.policy.tree.tenant_size(url_of(workers[0])) == 0
        assert router.policy.tree.tenant_size(url_of(workers[1])) > 0  # ...so its estimate stands
    for w in workers:
        await w.close()


async def test_remove_joins_the_running_drain_and_add_waits_for_it():
    held = Held()
    worker = await serve(held.app)
    url = url_of(worker)
    async with router_over([url], drain_timeout_secs=30) as (router, http):
        pending = asyncio.create_task(http.post("/generate", json={"text": "x"}))
        await wait_until(lambda: len(held.seen) == 1, what="the request to arrive")
        leaving = asyncio.create_task(http.post("/remove_worker", params={"url": url}))
        await wait_until(lambda: router.workers[url].draining, what="the drain to start")
        leaving.cancel()  # the caller hangs up: the drain goes on
        await asyncio.sleep(0.05)
        assert router.workers[url].draining and url in router._removals
        joined = asyncio.create_task(http.post("/remove_worker", params={"url": url}))
        added = asyncio.create_task(http.post("/add_worker", params={"url": url}))
        await asyncio.sleep(0.05)
        assert not joined.done() and not added.done()
        held.release_all()
        assert (await pending).status == 200
        assert (await (await joined).json()) == {"removed": url, "drained_requests": 1, "abandoned_requests": 0}
        assert (await added).status == 200 and not router.workers[url].draining
        assert router.policy.loads == {url: 0}
    await worker.close()


async def test_a_worker_that_was_unreachable_comes_back_with_no_cache_estimate():
    port = free_port()
    first = await serve(status_app(200, body={"text": "ok"}), port=port)
    async with router_over([url_of(first)], policy="cache_aware") as (router, http):
        await (await http.post("/generate", json={"text": "remember me"})).read()
        url = url_of(first)
        assert router.policy.tree.tenant_size(url) > 0
        await first.close()
        await router.check_health()
        assert router.workers[url].unreachable
        assert router.policy.tree.tenant_size(url) > 0  # unknown yet: it may come back as it was
        again = await serve(status_app(200, body={"text": "ok"}), port=port)
        await router.check_health()
        assert router.workers[url].healthy and router.policy.tree.tenant_size(url) == 0
        await again.close()
