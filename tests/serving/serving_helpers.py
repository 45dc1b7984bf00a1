"""Test-only pieces for the serving tests: real engines (tiny model, CPU), their greedy oracle, and real loopback
servers, some of which fail on purpose (503s, broken streams).

Every worker in these tests fronts a real ``local_client(Engine(...))``. The oracle for its text is a separate
``Engine`` built from the same seed with the radix cache off, stepped synchronously: greedy decoding is deterministic,
so text through the worker (and the router) must equal it.
"""
from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from framework.core.ports import free_ports
from framework.dist.group import Group
from framework.instance.client import InstanceClient, local_client
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.model.config import ModelConfig
from plugins.moe.reference import ReferenceConfig as MoEConfig   # moe=reference
from framework.contracts.parallel import ParallelConfig, Parallelism

SEED = 0
KV_BUDGET_MB = 1.0  # 819 KV slots on the tiny model: a prompt of 820 bytes can never fit


def build_engine(kv_budget_mb: float = KV_BUDGET_MB, seed: int = SEED, radix_cache: bool = True) -> Engine:
    return Engine(ModelConfig(), EngineConfig(kv_budget_mb=kv_budget_mb, radix_cache=radix_cache, device="cpu"),
                  Parallelism(ParallelConfig(), Group()), MoEConfig(), seed=seed)


def engine_client(kv_budget_mb: float = KV_BUDGET_MB, seed: int = SEED) -> InstanceClient:
    """A real engine stepping in its own thread, as ``serve_worker`` runs it; ``close()`` it when done."""
    return local_client(build_engine(kv_budget_mb, seed))


@functools.lru_cache(maxsize=1)
def _reference_engine() -> Engine:
    return build_engine(kv_budget_mb=4.0, radix_cache=False)


@functools.lru_cache(maxsize=None)
def greedy(prompt: str, max_new_tokens: int, stop: tuple[str, ...] = (), ignore_eos: bool = True) -> Req:
    """The oracle: ``prompt`` run alone, greedily, on a separate engine built from the same seed (blocks the caller)."""
    engine = _reference_engine()
    req = Req(engine.tokenizer.encode(prompt), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                                              stop=list(stop)))
    engine.add(req)
    while engine.scheduler.has_work():
        engine.step()
    return req


def greedy_text(prompt: str, max_new_tokens: int, **kw) -> str:
    return _reference_engine().tokenizer.decode(greedy(prompt, max_new_tokens, **kw).output_ids)


def engine_requests(client: InstanceClient) -> int:
    """Requests the engine holds right now (queued, prefilling or decoding), read live from the asyncio thread."""
    return client.local_engine.scheduler.num_requests()


def engine_stats(client: InstanceClient) -> dict:
    """The scheduler's step counters (extend_steps: one per prefill step, decode_steps), read live."""
    return dict(client.local_engine.scheduler.stats)


def break_model(client: InstanceClient) -> None:
    """A real engine crash: the vocabulary projection is swapped for a tensor of the wrong shape (as if a checkpoint
    of another model were loaded into it), so the next forward pass raises a genuine torch RuntimeError on the engine
    thread. No method is patched; ``the local client`` then fails the requests in flight and sets ``error``."""
    client.local_engine.model.lm_head.data = torch.zeros(1, 1)


def free_port() -> int:
    """A port for a server that starts later, at a URL known before (a worker that comes up late): chosen outside the
    kernel's ephemeral range, so the test's own connections cannot take it meanwhile. A server that starts now binds
    port 0 instead (``serve(app)``)."""
    return free_ports("127.0.0.1", 1)[0]


async def serve(app: web.Application, port: int | None = None) -> TestServer:
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server()
    return server


def url_of(server: TestServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def status_app(status: int, body: dict | None = None, calls: list | None = None,
               headers: dict | None = None) -> web.Application:
    """A worker that answers every generation route with ``status`` (a failing or overloaded server); ``calls``
    collects each request it got."""
    async def handler(request: web.Request) -> web.Response:
        if calls is not None:
            calls.append(request)
        return web.json_response(body or {"error": {"message": f"stub says {status}"}}, status=status,
                                 headers=headers)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, handler)
    app.router.add_get("/health", health)
    return app


def broken_stream_app(chunks_before_break: int = 2) -> web.Application:
    """A worker that starts an SSE stream and then drops the connection mid-stream."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks_before_break):
            await resp.write(f'data: {{"text": "{i}"}}\n\n'.encode())
            await asyncio.sleep(0.01)
        request.transport.close()  # no terminating chunk: the router sees a payload error
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_get("/health", health)
    return app


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0,
                     what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE response, each as soon as it has arrived."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            yield event[len(b"data: "):]


async def read_sse(resp: aiohttp.ClientResponse) -> list[bytes]:
    """The ``data:`` payloads of an SSE response, in order."""
    return [event async for event in iter_sse(resp)]
