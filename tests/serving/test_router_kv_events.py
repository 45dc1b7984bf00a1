"""The exact view end to end over real sockets: real engines publish their radix caches' KV events (ZMQ on loopback),
the router subscribes to each worker at the endpoint it advertises, and its precise_prefix policy's estimate of each
request's cached prompt tokens is what the worker then reports (meta_info.cached_tokens), to the block. Also: the
usage the router reads back, a flush that clears the view, SGLang's /get_load, and load reports reaching a policy."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import aiohttp
import pytest

from framework.kv_events.worker import publish_cache_events
from framework.core.registry import ROUTING
from framework.serving.router.service import start_router
from framework.serving.router.config import RouterServiceConfig
from framework.serving.worker import create_worker_app
from framework.load.http_client import parse_route
from serving_helpers import engine_client, engine_requests, serve, url_of, wait_until

pytestmark = pytest.mark.anyio
B = 8


@asynccontextmanager
async def cluster(policy):
    clients = [engine_client(), engine_client()]
    pubs, servers = [], []
    try:
        for c in clients:
            pub, info = publish_cache_events(c, "127.0.0.1", B)
            pubs.append(pub)
            servers.append(await serve(create_worker_app(c, model_name="tiny", extra_info={"kv_events": info})))
        router_server = await start_router(policy, [url_of(s) for s in servers], RouterServiceConfig(
            health_check_interval_secs=0.05, load_poll_interval_s=0.05), port=0)
        router = router_server.router
        if router.events.kv:
            await wait_until(lambda: len(router.events.subscribers) == 2, what="the router to subscribe to both")
            await asyncio.sleep(0.3)  # the SUB sockets' subscriptions reach the publishers
        async with aiohttp.ClientSession(router_server.url) as http:
            yield router, http, clients
        await router_server.cleanup()
    finally:
        for s in servers:
            await s.close()
        for c, p in zip(clients, pubs):
            c.close()
            p.close()


async def settled(router, clients):
    """Every engine idle and every batch it published received."""
    await wait_until(lambda: all(engine_requests(c) == 0 for c in clients), what="the engines to go idle")
    await asyncio.sleep(0.15)


async def test_estimate_matches_the_workers_cached_tokens_to_the_block():
    policy = ROUTING.get("precise_prefix")(ROUTING.get("precise_prefix").Config(block_size=B, cache_threshold=0.2))
    async with cluster(policy) as (router, http, clients):
        systems = ["You are a careful assistant who answers in French. " * 3, "Tools: search(q), fetch(url). " * 4]
        for i in range(12):
            text = f"{systems[i % 2]}question {i // 2}: what is {i * 7}?"
            body = {"text": text, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            async with http.post("/generate", json=body) as r:
                assert r.status == 200
                cached = (await r.json())["meta_info"]["cached_tokens"]
                route = r.headers["X-Servelab-Route"]
            estimate = policy.last_decision.matched_chars
            assert estimate <= cached < estimate + B, (i, estimate, cached)
            # the decision goes back with the answer: the load client records it beside the worker's count
            assert parse_route(route) == (policy.last_decision.reason, estimate), route
            await settled(router, clients)
        assert policy.last_decision.reason == "cache_hit" and policy.last_decision.matched_chars > 100
        stats = await (await http.get("/router_stats")).json()
        assert set(stats["kv_events"]) == set(router.workers)
        assert all(s.get("resyncs", 0) == 0 for s in stats["kv_events"].values())
        assert sum(s.get("batches", 0) for s in stats["kv_events"].values()) > 0
        assert stats["reported_requests"] == 12 and stats["reported_hit_rate"] >= stats["estimated_hit_rate"]
        # a flush empties the caches: AllBlocksCleared empties the view
        assert (await http.post("/flush_cache")).status == 200
        await settled(router, clients)
        assert policy.view.cached_blocks(policy.workers[0]) == policy.view.cached_blocks(policy.workers[1]) == 0


async def test_load_reports_reach_a_policy_that_follows_them():
    policy = ROUTING.get("power_of_two")(ROUTING.get("power_of_two").Config(load="worker_tokens"))
    async with cluster(policy) as (router, http, clients):
        async with http.get(router.workers[policy.workers[0]].url + "/get_load") as r:
            load = await r.json()
        assert load[0]["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
        await wait_until(lambda: len(policy._reported) == 2, what="a load report from each worker")


async def test_a_request_held_for_a_prefix_in_flight_is_sent_once_it_is_stored():
    """hold_s: the second of two requests with one long prefix, sent while the first is still being prefilled, waits at
    the router for the first's BlockStored events, then hits the whole shared prefix (to the block)."""
    cls = ROUTING.get("precise_prefix")
    policy = cls(cls.Config(block_size=B, cache_threshold=0.2, hold_s=10.0))
    async with cluster(policy) as (router, http, clients):
        prefix = "A long shared preamble that two requests send at once, one after the other. " * 7  # 2 chunks

        async def send(i):
            body = {"text": f"{prefix}question {i}", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
            async with http.post("/generate", json=body) as r:
                assert r.status == 200
                return (await r.json())["meta_info"]["cached_tokens"]

        first = asyncio.create_task(send(0))
        await wait_until(lambda: policy.last_decision is not None, what="the first request to be routed")
        cached = await send(1)
        assert await first == 0
        shared = len(prefix.encode()) + len("question ")
        assert cached >= shared // B * B, (cached, shared)
        stats = await (await http.get("/router_stats")).json()
        assert stats["holds"] == 1 and stats["reasons"] == {"cache_miss": 1, "cache_hit": 1}


async def test_a_client_that_leaves_while_its_request_is_held_leaves_no_count_behind():
    """The hold sits between the decision (which counts the request on its worker and credits its blocks) and the
    attempt: a disconnect there must undo the decision as a failed attempt would."""
    cls = ROUTING.get("precise_prefix")

    class AlwaysHold(cls):
        def hold_s(self, decision):
            return 30.0

    policy = AlwaysHold(cls.Config(block_size=B))
    async with cluster(policy) as (router, http, clients):
        body = {"text": "a request held for longer than its client waits", "sampling_params": {"max_new_tokens": 2}}
        with pytest.raises(asyncio.TimeoutError):
            await http.post("/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.3))
        await wait_until(lambda: sum(policy.loads.values()) == 0, what="the held request's count to be released")
        assert all(w.in_flight == 0 for w in router.workers.values())
        assert all(policy.view.match(policy.view.keys.chain(body["text"].encode()), [w])[w] == 0
                   for w in policy.workers)  # its blocks' credit was taken back
