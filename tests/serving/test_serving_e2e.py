"""The real engine (tiny model, CPU) behind the worker app, behind the router, over loopback HTTP.

Oracles: greedy decoding is deterministic, so the text through the router equals the text straight from the worker,
and a stream's deltas concatenate to the non-streamed text; a repeated prompt is served from the radix cache."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from framework.core.registry import ROUTING
from framework.serving.router.service import create_router_app
from framework.serving.router.config import RouterServiceConfig
from framework.serving.worker import create_worker_app
from serving_helpers import engine_client, read_sse, serve, url_of, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def stack():
    client = engine_client(kv_budget_mb=4.0)  # 3276 KV slots: room for the 2000-token request below
    worker = await serve(create_worker_app(client, model_name="tiny"))
    router = await serve(create_router_app(ROUTING.get("round_robin")(), [url_of(worker)],
                                           RouterServiceConfig(health_check_interval_secs=0.1)))
    try:
        async with aiohttp.ClientSession() as http:
            yield client, http, url_of(worker), url_of(router)
    finally:
        await router.close()
        await worker.close()
        client.close()


async def test_router_and_worker_agree_with_the_real_engine(stack):
    client, http, worker, router = stack
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    async with http.post(worker + "/v1/completions", json=body) as r:
        direct = await r.json()
    async with http.post(router + "/v1/completions", json=body) as r:
        assert r.status == 200
        routed = await r.json()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"]["completion_tokens"] == 8 and routed["choices"][0]["finish_reason"] == "length"
    assert routed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again: radix cache hit

    async with http.post(router + "/v1/completions", json={**body, "stream": True}) as r:
        events = await read_sse(r)
    assert events[-1] == b"[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == direct["choices"][0]["text"]

    native = {"text": body["prompt"], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    async with http.post(router + "/generate", json=native) as r:
        out = await r.json()
    assert out["text"] == direct["choices"][0]["text"] and out["meta_info"]["completion_tokens"] == 8


async def test_client_disconnect_through_the_router_frees_the_engine(stack):
    client, http, worker, router = stack
    body = {"text": "a long story", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}
    async with http.post(router + "/generate", json=body) as r:
        await r.content.readany()
    live = client.local_engine.server_info  # read live: the local client.server_info() is refreshed only after a step
    await wait_until(lambda: live()["running_requests"] == live()["queued_requests"] == 0, timeout=10,
                     what="the engine to drop the aborted request")
    steps = live()["decode_steps"]
    await asyncio.sleep(0.3)
    assert live()["decode_steps"] == steps  # nothing is generating any more (2000 tokens were asked for)


async def test_engine_rejection_passes_through_the_router_as_a_400(stack):
    client, http, worker, router = stack
    too_long = "x" * (client.local_engine.capacity + 1)  # can never fit the KV pool: the engine raises ValueError
    async with http.post(router + "/v1/completions", json={"prompt": too_long, "max_tokens": 1}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "prompt"
    async with http.get(router + "/list_workers") as r:
        assert (await r.json())["workers"][0]["failures"] == 0
