"""Each fault the FaultProxy injects, in front of a real worker (real engine, in this process), behind the router,
driven by the load client: what the client sees, what the router counts, and that the worker behind is left clean.
A second real worker is always there to take what the faulty one drops."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

import aiohttp
import pytest

from fault_helpers import grouped_sessions
from framework.core.registry import ROUTING
from framework.testing.faults import FaultPlan, FaultProxy
from framework.serving.router.service import ROUTER_KEY, create_router_app
from framework.serving.router.config import RouterServiceConfig
from framework.serving.worker import create_worker_app
from framework.load.http_client import LoadClient
from plugins.workload.shared_prefix import SharedPrefixConfig
from serving_helpers import engine_client, engine_requests, free_port, greedy_text, serve, url_of, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def engines():
    clients = [engine_client(), engine_client()]
    yield clients
    for c in clients:
        c.close()


@asynccontextmanager
async def faulty_cluster(engines, plan: FaultPlan, **router_cfg):
    """Two real workers, the first behind a FaultProxy, and a cache-aware router over [proxy, worker 2]."""
    workers = [await serve(create_worker_app(c, model_name="tiny")) for c in engines]
    proxy = FaultProxy(url_of(workers[0]), plan)
    front = await serve(proxy.app(), port=free_port())  # outside the ephemeral range: a test reopens it
    cfg = RouterServiceConfig(**{**dict(health_check_interval_secs=0.1, health_check_timeout_secs=0.5,
                                        retry_backoff_base_s=0.001, retry_backoff_max_s=0.01), **router_cfg})
    app = create_router_app(ROUTING.get("cache_aware")(), [url_of(front), url_of(workers[1])], cfg)
    router = await serve(app)
    try:
        yield app[ROUTER_KEY], url_of(router), proxy, front
    finally:
        for s in (router, front, *workers):
            await s.close()
    for c in engines:
        await wait_until(lambda: engine_requests(c) == 0, what="the engines to drop every request")
    assert all(n == 0 for n in app[ROUTER_KEY].policy.loads.values())


async def play(router_url: str, groups: int = 4, turns: int = 3, seed: int = 0):
    client = LoadClient(router_url, SharedPrefixConfig(max_concurrency=8), retries=2, request_timeout_s=30)
    records, _ = await client.play_async(grouped_sessions(groups, turns, seed, prefix_chars=64))
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    return client, records


async def test_a_delay_below_every_timeout_changes_nothing_but_latency(engines):
    async with faulty_cluster(engines, FaultPlan(delay_s=0.2)) as (router, url, proxy, front_server):
        front = url_of(front_server)
        client, records = await play(url)
        assert proxy.counts["forwarded"] > 0 and router.stats.retries == client.retries == 0
        assert min(r.ttft_s for r in records if r.worker == front) >= 0.2


async def test_a_share_of_500s_is_retried_elsewhere_and_counts_against_the_worker(engines):
    async with faulty_cluster(engines, FaultPlan(error_rate=0.5, seed=3)) as (router, url, proxy, front_server):
        front = url_of(front_server)
        client, _ = await play(url)
        assert proxy.counts["error_500"] >= 1 and client.retries == 0
        assert router.stats.retries == proxy.counts["error_500"] == router.workers[front].failures


async def test_a_stream_reset_midway_ends_in_an_error_event_and_the_client_retries(engines):
    """The worker got the text (cache-aware would send the retry back to it): its breaker, opened by the broken
    stream, sends the client's retry elsewhere."""
    async with faulty_cluster(engines, FaultPlan(reset_rate=1.0, reset_after_chunks=2),
                              breaker_failure_threshold=1) as (router, url, proxy, front_server):
        front = url_of(front_server)
        client, records = await play(url, groups=2, turns=2)
        assert proxy.counts["reset"] == 1 and client.retries == 1 and router.workers[front].breaker.state == "open"
        assert router.stats.outcomes["/generate", "broken_stream"] == 1


async def test_a_hung_worker_gives_504s_the_client_retries_elsewhere(engines):
    async with faulty_cluster(engines, FaultPlan(), request_timeout_s=0.5, abort_timeout_s=0.3,
                              health_check_interval_secs=0.5) as (router, url, proxy, front_server):
        front = url_of(front_server)
        proxy.set_plan(FaultPlan(hang=True))  # healthy a moment ago: the router still sends it requests
        client, records = await play(url, groups=2, turns=1)
        assert client.retries >= 1 and router.stats.outcomes["/generate", "timeout"] == client.retries
        assert router.stats.retries == 0  # it could not confirm an abort: the router never doubles the request
        assert {r.worker for r in records} == {url_of_other(router, front)}
        await wait_until(lambda: not router.workers[front].healthy, what="the health check to time out")
        assert router.workers[front].failures == 0  # hung, not broken


async def test_a_crashed_worker_is_retried_elsewhere_and_comes_back_cold(engines):
    async with faulty_cluster(engines, FaultPlan(), health_check_interval_secs=5) as (
            router, url, proxy, front_server):
        front = url_of(front_server)
        await play(url)  # the tree credits both workers with their prefixes
        credit = router.policy.tree.tenant_size(front)
        assert credit > 0
        proxy.set_plan(FaultPlan(crash=True))  # connections reset: requests still go to it and fail at once
        client, records = await play(url, groups=2, turns=1, seed=1)
        assert proxy.counts["crashed"] >= 1 and router.stats.retries >= 1 and client.retries == 0
        assert router.workers[front].failures >= 1 and router.policy.tree.tenant_size(front) == credit  # taken back
        proxy.set_plan(FaultPlan())
        port = front_server.port
        await front_server.close()  # gone: nothing listens on its port
        await router.check_health()
        assert router.workers[front].unreachable and not router.workers[front].healthy
        back = await serve(proxy.app(), port=port)  # back on the same port, with an empty cache...
        await router.check_health()
        assert router.workers[front].healthy and router.policy.tree.tenant_size(front) == 0  # ...and no credit
        await back.close()


async def test_the_load_client_honours_retry_after(engines):
    async with faulty_cluster(engines, FaultPlan(error_rate=1.0, error_status=429, retry_after_s=1)) as (
            router, url, proxy, front_server):
        front = url_of(front_server)
        async with aiohttp.ClientSession() as http:  # straight at the proxy: the client sees the 429 itself
            client = LoadClient(front, SharedPrefixConfig(), retries=1, request_timeout_s=10)
            t0 = time.perf_counter()
            record, _ = await client.request(http, client.payload(grouped_sessions(1, 1, 0)[0], 0, []))
        assert not record.ok and "HTTP 429" in record.error and client.retries == 1
        assert time.perf_counter() - t0 >= 1.0 and proxy.counts["error_429"] == 2


def url_of_other(router, front: str) -> str:
    return next(u for u in router.workers if u != front)


async def test_text_through_the_faults_is_the_engines(engines):
    """What survives the faults is still the real engine's greedy text (the oracle)."""
    async with faulty_cluster(engines, FaultPlan(error_rate=0.5, delay_s=0.05, seed=1)) as (router, url, _, _):
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                body = {"text": f"oracle {i}", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
                async with http.post(url + "/generate", json=body) as r:
                    assert r.status == 200 and (await r.json())["text"] == greedy_text(f"oracle {i}", 5)
