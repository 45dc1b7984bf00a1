"""The HTTP router tells a listening policy (token_jsq) of a streamed answer's first chunk: the prompt's pending tokens
leave then, the request's last one when it ends (real loopback HTTP, one streaming worker held between chunks)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from framework.core.registry import ROUTING
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import start_router

pytestmark = pytest.mark.anyio


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_http_router_releases_token_jsq_s_prompt_tokens_at_the_first_chunk():
    go = asyncio.Event()

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "a"}\n\n')
        await go.wait()                                   # the rest only once the test has looked
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    worker = TestServer(app, host="127.0.0.1")
    await worker.start_server()
    url = f"http://127.0.0.1:{worker.port}"
    policy = ROUTING.get("token_jsq")()
    server = await start_router(policy, [url], RouterServiceConfig(health_check_interval_secs=0.05), port=0)
    try:
        await _until(lambda: server.router.core.workers[url].healthy)
        async with aiohttp.ClientSession(server.url) as http:
            async with http.post("/generate", json={"text": "hello world", "stream": True}) as r:
                assert r.status == 200
                assert (await r.content.readuntil(b"\n\n")).startswith(b"data:")
                assert policy.pending[url] == 1           # 11 + 1 credited; the prompt's 11 left at the first chunk
                go.set()
                await r.read()
        await _until(lambda: policy.pending[url] == 0)    # the last one at the end
    finally:
        go.set()
        await server.cleanup()
        await worker.close()
