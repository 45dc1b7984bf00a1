"""A fault-injecting proxy in front of one worker, for chaos tests (tests/faults, experiments/chaos).

Everything is forwarded to ``upstream`` (generation routes, /health, /abort_request, ...), streams chunk by chunk,
except what the ``FaultPlan`` says to break: a delay before each generation request, a share of them answered with
an error status (with Retry-After when asked, e.g. 429/503), a share of streams reset after some chunks, ``hang``
(nothing is ever answered, /health included: a stopped process) and ``crash`` (every connection is reset at once: a
dead one). The plan changes at run time with ``POST /faults`` (its fields as JSON); ``GET /faults`` returns it and
what the proxy did (``counts``); ``events`` keeps when each generation request arrived and each fault was injected.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from framework.serving.http.proxy import NOT_FORWARDED, NOT_RETURNED, pass_headers

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass
class FaultPlan:
    delay_s: float = 0.0               # before each generation request is forwarded
    error_rate: float = 0.0            # share of generation requests answered with error_status instead
    error_status: int = 500
    retry_after_s: float | None = None  # sent with the error status
    reset_rate: float = 0.0            # share of streams whose connection is reset after reset_after_chunks chunks
    reset_after_chunks: int = 1
    hang: bool = False                 # answer nothing, /health included
    crash: bool = False                # reset every connection at once, /health included
    seed: int = 0

    def check(self) -> None:
        if not (0 <= self.error_rate <= 1 and 0 <= self.reset_rate <= 1):
            raise ValueError(f"error_rate={self.error_rate} and reset_rate={self.reset_rate} must be in [0, 1]")
        if self.delay_s < 0 or self.reset_after_chunks < 0 or not 400 <= self.error_status <= 599:
            raise ValueError(f"delay_s={self.delay_s} and reset_after_chunks={self.reset_after_chunks} must be >= 0, "
                             f"error_status={self.error_status} a 4xx or 5xx")


class FaultProxy:
    def __init__(self, upstream: str, plan: FaultPlan | None = None):
        self.upstream = upstream.rstrip("/")
        self.counts: Counter[str] = Counter()
        self.events: list[tuple[float, str]] = []  # (time.monotonic(), "request" | a fault)
        self.session: aiohttp.ClientSession | None = None
        self.set_plan(plan or FaultPlan())

    def set_plan(self, plan: FaultPlan) -> None:
        plan.check()
        self.plan, self._rng = plan, random.Random(plan.seed)

    def app(self) -> web.Application:
        app = web.Application()
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        app.router.add_get("/faults", self._show)
        app.router.add_post("/faults", self._change)
        app.router.add_route("*", "/{path:.*}", self._forward)
        return app

    async def _open(self, app) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None),
                                             skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))

    async def _close(self, app) -> None:
        await self.session.close()

    async def _show(self, request: web.Request) -> web.Response:
        return web.json_response({"plan": dataclasses.asdict(self.plan), "counts": dict(self.counts)})

    async def _change(self, request: web.Request) -> web.Response:
        try:
            self.set_plan(FaultPlan(**await request.json()))
        except (TypeError, ValueError) as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        return await self._show(request)

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        self.events.append((time.monotonic(), what))

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        plan = self.plan
        if plan.crash:
            self._count("crashed")
            request.transport.abort()  # a reset, as from a port nothing listens on any more
            raise asyncio.CancelledError
        if plan.hang:
            self._count("hung")
            await asyncio.Event().wait()  # until the client gives up
        body = await request.read()
        generation = request.path in GENERATION_ROUTES
        if generation:
            self.events.append((time.monotonic(), "request"))
            if plan.delay_s:
                await asyncio.sleep(plan.delay_s)
            if self._rng.random() < plan.error_rate:
                self._count(f"error_{plan.error_status}")
                headers = {} if plan.retry_after_s is None else {"Retry-After": f"{plan.retry_after_s:g}"}
                return web.json_response({"error": {"message": f"injected {plan.error_status}"}},
                                         status=plan.error_status, headers=headers)
        reset = generation and self._rng.random() < plan.reset_rate
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                        headers=pass_headers(request.headers, NOT_FORWARDED)) as up:
            resp = web.StreamResponse(status=up.status, headers=pass_headers(up.headers, NOT_RETURNED))
            try:
                await resp.prepare(request)
                chunks = 0
                async for chunk in up.content.iter_any():
                    if reset and chunks >= plan.reset_after_chunks:
                        self._count("reset")
                        request.transport.abort()
                        return resp
                    await resp.write(chunk)
                    chunks += 1
                await resp.write_eof()
            except ConnectionResetError:  # the client left: so does the upstream request (closed on exit)
                return resp
        self.counts["forwarded" if generation else "control"] += 1
        return resp
