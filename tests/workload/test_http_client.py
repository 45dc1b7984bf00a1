"""The HTTP load client against a real worker (real engine) on loopback, with the in-process driver as the oracle;
failure paths against small stub servers that fail on purpose."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from framework.dist.group import Group
from framework.instance.client import local_client
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.model.config import ModelConfig
from framework.contracts.parallel import ParallelConfig, Parallelism
from framework.core.registry import MOE, WORKLOAD
from framework.serving.worker import create_worker_app
from plugins.workload.multi_turn import MultiTurnConfig
from plugins.workload.shared_prefix import SharedPrefixConfig
from framework.contracts.workload import Api
from framework.load.http_client import LoadClient
from framework.load.load_sampler import parse_in_flight
from framework.load.inprocess import play as play_inprocess

pytestmark = pytest.mark.anyio
ENGINE = EngineConfig(kv_budget_mb=1.0)      # ~800 tokens: small, the workloads below fit


def engine() -> Engine:
    return Engine(ModelConfig(), ENGINE, Parallelism(ParallelConfig(), Group()), MOE.get("reference").Config(), 0)


async def serve(app: web.Application) -> tuple[TestServer, str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def worker_url():
    client = local_client(engine())
    server, url = await serve(create_worker_app(client))
    yield url
    await server.close()
    client.close()


def sessions(name: str, cfg):
    return WORKLOAD.build(name, cfg, 0).sessions()


async def test_records_match_the_inprocess_driver(worker_url):
    """Sequential multi-turn: the same engine must report the same prompt, completion and cached tokens for every
    request, whether the requests come over HTTP (answers read back from the stream) or in-process."""
    cfg = MultiTurnConfig(num_conversations=3, turns=3, system_prompt_len=64, user_len=24, output_len=6,
                          max_concurrency=1)
    records, duration = await LoadClient(worker_url, cfg).play_async(sessions("multi_turn", cfg))
    expected, _ = play_inprocess(engine(), sessions("multi_turn", cfg), cfg, progress=False)
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    got = [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in records]
    assert got == [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in expected]
    assert sum(r.cached_tokens for r in records) > 0
    for r in records:
        assert 0 < r.ttft_s <= r.e2e_s <= duration and r.tpot_s is not None and r.worker == worker_url


async def test_concurrency_and_arrival_rate(worker_url):
    cfg = SharedPrefixConfig(num_groups=3, prompts_per_group=4, system_prompt_len=96, question_len=16, output_len=4,
                             max_concurrency=4, request_rate=20.0)
    ss = sessions("shared_prefix", cfg)
    records, duration = await LoadClient(worker_url, cfg).play_async(ss)
    assert len(records) == 12 and all(r.ok for r in records)
    assert duration >= ss[-1].arrival_s                          # the last request was not sent early
    assert sorted(r.prompt_tokens for r in records) == sorted(len(s.prompt(0, [])) for s in ss)
    assert sum(r.cached_tokens >= 96 for r in records) >= 12 - 3 - 3   # all but each group's first (+ in flight)


async def test_a_client_error_is_recorded_not_retried(worker_url):
    cfg = SharedPrefixConfig(num_groups=1, prompts_per_group=2, system_prompt_len=5000, output_len=4)
    client = LoadClient(worker_url, cfg, retries=3)
    records, _ = await client.play_async(sessions("shared_prefix", cfg))     # longer than the KV pool: a 400
    assert [r.ok for r in records] == [False, False] and client.retries == 0
    assert all("HTTP 400" in r.error for r in records)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_server_fails_every_request_without_raising():
    cfg = MultiTurnConfig(num_conversations=2, turns=3)
    client = LoadClient(f"http://127.0.0.1:{closed_port()}", cfg, retries=1)
    records, _ = await client.play_async(sessions("multi_turn", cfg))
    assert len(records) == 6 and not any(r.ok for r in records)
    assert client.retries == 2                                   # one retry per first turn; later turns not sent
    assert sum("not sent" in r.error for r in records) == 4
    assert all("Connect" in r.error for r in records if "not sent" not in r.error)


async def test_timeout_bounds_each_request():
    async def hang(request):
        await asyncio.sleep(30)
    app = web.Application()
    app.router.add_post("/generate", hang)
    server, url = await serve(app)
    cfg = SharedPrefixConfig(num_groups=1, prompts_per_group=2)
    t0 = time.perf_counter()
    records, _ = await LoadClient(url, cfg, request_timeout_s=0.3).play_async(sessions("shared_prefix", cfg))
    assert time.perf_counter() - t0 < 3
    assert all(not r.ok and "timed out after 0.3s" in r.error for r in records)
    await server.close()


async def test_a_broken_stream_is_sent_again():
    calls = []

    async def flaky(request):
        calls.append(1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        meta = '"meta_info": {"prompt_tokens": 3, "completion_tokens": %d, "cached_tokens": 1}'
        await resp.write(b'data: {"text": "a", %s}\n\n' % (meta % 1).encode())
        if len(calls) == 1:                      # the first try dies mid-stream, as a killed worker's would
            await resp.write(b'data: {"error": {"message": "worker broke the stream"}}\n\n')
            return resp
        await resp.write(b'data: {"text": "ab", %s}\n\ndata: [DONE]\n\n' % (meta % 2).encode())
        return resp
    app = web.Application()
    app.router.add_post("/generate", flaky)
    server, url = await serve(app)
    cfg = SharedPrefixConfig(num_groups=1, prompts_per_group=1)
    client = LoadClient(url, cfg, retries=2)
    records, _ = await client.play_async(sessions("shared_prefix", cfg))
    assert client.retries == 1 and len(calls) == 2
    (r,) = records
    assert r.ok and (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (3, 2, 1)
    await server.close()


async def flush(url: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(url + "/flush_cache", json={}) as resp:
        assert resp.status == 200


async def test_openai_apis_report_what_native_reports(worker_url):
    """The same multi-turn workload through /v1/completions gives the native API's token counts request for request
    (the worker's own usage); through chat every request completes, with the history cached."""
    cfg = MultiTurnConfig(num_conversations=2, turns=3, system_prompt_len=48, user_len=16, output_len=5,
                          max_concurrency=1)
    native, _ = await LoadClient(worker_url, cfg).play_async(sessions("multi_turn", cfg))
    await flush(worker_url)
    cfg.api = Api.completions
    client = LoadClient(worker_url, cfg)
    completions, _ = await client.play_async(sessions("multi_turn", cfg))
    assert client.model == "servelab"                      # asked GET /v1/models, as vLLM needs
    key = lambda r: (r.session, r.turn)                    # noqa: E731
    assert [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in sorted(completions, key=key)] == \
        [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in sorted(native, key=key)]
    await flush(worker_url)
    cfg.api = Api.chat
    chat, _ = await LoadClient(worker_url, cfg).play_async(sessions("multi_turn", cfg))
    assert all(r.ok for r in chat), [r.error for r in chat]
    assert [r.completion_tokens for r in sorted(chat, key=key)] == \
        [r.completion_tokens for r in sorted(native, key=key)]
    assert all(r.cached_tokens > 0 for r in chat if r.turn > 0)
    for r in native:       # the native stream carries every token as an event: one gap per token after the first
        assert len(r.itl_s) == r.completion_tokens - 1 and r.ttft_s + sum(r.itl_s) <= r.e2e_s


async def test_max_concurrency_counts_requests_not_sessions():
    """bench_serving's --max-concurrency: at most N requests in flight; a session thinking between turns holds no
    slot, so other sessions start meanwhile."""
    state = {"now": 0, "peak": 0}

    async def slow(request):
        await request.read()
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        meta = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
        return web.Response(text=f"data: {json.dumps({'text': 'a', 'meta_info': meta})}\n\ndata: [DONE]\n\n",
                            content_type="text/event-stream")
    app = web.Application()
    app.router.add_post("/generate", slow)
    server, url = await serve(app)
    cfg = MultiTurnConfig(num_conversations=6, turns=2, system_prompt_len=4, max_concurrency=2, think_time_s=0.2,
                          sample_interval_s=0)
    records, _ = await LoadClient(url, cfg).play_async(sessions("multi_turn", cfg))
    assert len(records) == 12 and all(r.ok for r in records) and state["peak"] == 2
    first_six = sorted(records, key=lambda r: r.send_s)[:6]    # every conversation's first turn before any second
    assert {(r.session, r.turn) for r in first_six} == {(f"conv-{i}", 0) for i in range(6)}
    await server.close()


def test_the_load_sampler_reads_both_routers_series():
    servelab = ('# HELP x\nservelab_router_worker_in_flight{worker="http://a:1"} 3.0\n'
                'servelab_router_worker_healthy{worker="http://a:1"} 1.0\n'
                'servelab_router_worker_in_flight{worker="http://b:2"} 0.0\n')
    sglang = 'smg_worker_requests_active{worker="http://a:1"} 7\nsmg_worker_health{worker="http://a:1"} 1\n'
    assert parse_in_flight(servelab) == {"http://a:1": 3.0, "http://b:2": 0.0}
    assert parse_in_flight(sglang) == {"http://a:1": 7.0}
    assert parse_in_flight("vllm:num_requests_running 4\n") == {}


def test_route_header_is_read_back_and_anything_else_is_unknown():
    from framework.contracts.routing import RoutingDecision
    from framework.serving.http.proxy import route_header
    from framework.load.http_client import parse_route
    assert parse_route(route_header(RoutingDecision("http://w", 512, 600, "cache_hit"))) == ("cache_hit", 512)
    assert parse_route("") == ("", None)                    # not servelab's router: no header
    assert parse_route("session; estimate=x") == ("session", None)
