"""The worker HTTP server: SGLang's native API and OpenAI's API in front of one engine instance.

The server speaks to the engine only through ``framework.instance.handle.EngineHandle`` (one rank or many), streaming
with ``handle.generate``. A client that disconnects cancels its handler (``handler_cancellation``), and ``aclosing``
closes the engine's iterator, which frees the request in the engine. ``POST /abort_request``
(SGLang's, ``{"rid": ...}``) does the same for the requests with that id (the ``X-Request-Id`` header, else the native
``rid``) and says how many it aborted, so a router can tell a worker that dropped a request from one that is hung.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import aclosing
from functools import partial
from typing import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from framework.engine.disagg import Pairing
from framework.instance.handle import EngineHandle, GenerateOutput, generate
from framework.serving.http import protocol as P
from framework.serving.http.errors import ApiError, json_bytes, parse_body
from framework.serving.http.server_base import DEFAULT_CLIENT_MAX_SIZE, make_app, metrics_response, serve_forever

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}



from framework.routing.dp_aware import DP_RANK_HEADER   # another way to name a DP group (servelab's router)


def dp_rank_of(request, req) -> int | None:
    """The DP group a request names: SGLang's `data_parallel_rank` body field (of /generate, and of the OpenAI endpoints
    as sglang-router --dp-aware sends it), or the header; None: the instance's DP controller picks."""
    header = request.headers.get(DP_RANK_HEADER)
    if header is None:
        return getattr(req, "data_parallel_rank", None)
    if not header.isdigit():
        raise ApiError(400, f"{DP_RANK_HEADER}: {header!r} is not a DP rank (an integer >= 0)", param=DP_RANK_HEADER)
    return int(header)

class _Result:
    """Accumulates the engine's incremental outputs into one request's text, counts and finish reason."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.failed = False  # the engine failed after the stream had started
        self.first_token_s: float | None = None
        self.kv_transfer_bytes, self.kv_transfer_s = 0, 0.0   # disaggregated: the decode side's transfer figures
        self.engine_ttft_s: float | None = None

    def add(self, out: GenerateOutput) -> None:
        if out.text:
            self.parts.append(out.text)
        if self.first_token_s is None and (out.token_ids or out.text):
            self.first_token_s = time.perf_counter()
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        self.kv_transfer_bytes, self.kv_transfer_s = out.kv_transfer_bytes, out.kv_transfer_s
        self.engine_ttft_s = out.engine_ttft_s          # (None until the first token; kept from then on)
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def usage(self) -> P.Usage:
        return P.Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class WorkerMetrics:
    """Prometheus series in a per-app registry (several workers can live in one process, e.g. in tests)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("servelab_worker_requests", "Finished requests", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("servelab_worker_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("servelab_worker_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("servelab_worker_cached_tokens", "Prompt tokens served from cache", registry=r)
        self.in_flight = Gauge("servelab_worker_http_in_flight", "Generation requests being served", registry=r)
        self.running = Gauge("servelab_worker_running_requests", "Engine: running requests", registry=r)
        self.queued = Gauge("servelab_worker_queued_requests", "Engine: queued requests", registry=r)
        self.latency = Histogram("servelab_worker_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint"], registry=r)
        self.ttft = Histogram("servelab_worker_time_to_first_token_seconds", "Time to first token",
                              ["endpoint"], registry=r)

    def finish(self, endpoint: str, outcome: str, res: _Result, t0: float) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(res.prompt_tokens)
        self.completion_tokens.inc(res.completion_tokens)
        self.cached_tokens.inc(res.cached_tokens)
        self.latency.labels(endpoint).observe(time.perf_counter() - t0)
        if res.first_token_s is not None:
            self.ttft.labels(endpoint).observe(res.first_token_s - t0)


class _Formatter:
    """Turns engine outputs into one API's response body or SSE events."""

    def __init__(self, kind: str, req, model_name: str):
        self.kind, self.req, self.model = kind, req, model_name
        self.id = (req.rid if kind == "generate" and req.rid else
                   P.new_id({"generate": "gen", "completions": "cmpl", "chat": "chatcmpl"}[kind]))
        self.created = P.now_s()
        self.sent_role = False
        self.paired = False           # a disaggregated request: meta_info carries its KV transfer

    def full(self, res: _Result) -> P.BaseModel:
        if self.kind == "generate":
            return P.GenerateResponse(text=res.text, meta_info=self._meta(res))
        if self.kind == "completions":
            return P.CompletionResponse(id=self.id, created=self.created, model=self.model, usage=res.usage(),
                                        choices=[P.CompletionChoice(text=res.text, finish_reason=res.finish_reason)])
        msg = P.ChatMessageOut(content=res.text)
        return P.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=res.usage(),
                                        choices=[P.ChatChoice(message=msg, finish_reason=res.finish_reason)])

    def chunk(self, out: GenerateOutput, res: _Result) -> bytes:
        reason = out.finish_reason if out.finished else None
        if self.kind == "generate":  # native streaming: cumulative text every event
            return P.sse(P.GenerateResponse(text=res.text, meta_info=self._meta(res)))
        if self.kind == "completions":
            return P.sse(P.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                              choices=[P.CompletionChoice(text=out.text, finish_reason=reason)]))
        delta = P.ChatDelta(content=out.text, role=None if self.sent_role else "assistant")
        self.sent_role = True
        return P.sse(P.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                           choices=[P.ChatStreamChoice(delta=delta, finish_reason=reason)]))

    def tail(self, res: _Result) -> bytes:
        """After the last chunk: OpenAI's optional usage chunk (``stream_options.include_usage``), then [DONE]."""
        if self.kind != "generate" and self.req.include_usage:
            cls = P.CompletionResponse if self.kind == "completions" else P.ChatCompletionChunk
            usage_chunk = cls(id=self.id, created=self.created, model=self.model, choices=[], usage=res.usage())
            return P.sse(usage_chunk) + P.SSE_DONE
        return P.SSE_DONE

    def _meta(self, res: _Result) -> P.MetaInfo:
        reason = P.native_finish_reason(res.finish_reason, res.completion_tokens)
        if self.paired:
            return P.PairedMetaInfo(id=self.id, prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
                                    completion_tokens=res.completion_tokens, finish_reason=reason,
                                    engine_ttft_s=res.engine_ttft_s,
                                    kv_transfer_bytes=res.kv_transfer_bytes, kv_transfer_s=res.kv_transfer_s)
        return P.MetaInfo(id=self.id, prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                          cached_tokens=res.cached_tokens, finish_reason=reason, engine_ttft_s=res.engine_ttft_s)


class WorkerServer:
    """Request handlers over one engine; ``create_worker_app`` wires them into an aiohttp app."""

    MODELS = {"generate": P.GenerateRequest, "completions": P.CompletionRequest, "chat": P.ChatCompletionRequest}
    PROMPT_FIELDS = {"generate": "text", "completions": "prompt", "chat": "messages"}  # named by engine rejections

    def __init__(self, engine: EngineHandle, model_name: str, extra_info: dict | None = None):
        self.engine, self.model_name = engine, model_name
        self.extra_info = extra_info or {}  # added to /get_server_info (e.g. where its KV events are published)
        self.metrics = WorkerMetrics()
        self.in_flight = 0
        self._by_rid: dict[str, set[asyncio.Task]] = {}  # request id -> the handlers serving it (for /abort_request)

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        req = parse_body(self.MODELS[kind], await request.read())
        prompt = req.prompt_text() if kind == "chat" else (req.text if kind == "generate" else req.prompt)
        params, field = req.to_sampling_params(), self.PROMPT_FIELDS[kind]
        pairing, params = self._pairing(req, params)
        start = partial(self._generate, prompt, params, field, dp_rank_of(request, req), pairing)
        fmt, res, t0 = _Formatter(kind, req, self.model_name), _Result(), time.perf_counter()
        fmt.paired = pairing is not None
        outcome = "cancelled"
        self.in_flight += 1
        self.metrics.in_flight.inc()
        rid = request.headers.get("X-Request-Id") or (req.rid if kind == "generate" else None)
        task = asyncio.current_task()
        if rid:
            self._by_rid.setdefault(rid, set()).add(task)
        try:
            if req.stream:
                resp = await self._stream(request, fmt, res, start)
            else:
                await self._collect(res, start)
                resp = web.Response(body=fmt.full(res).model_dump_json(), content_type="application/json")
            outcome = "error" if res.failed else res.finish_reason or "client_disconnect"
            return resp
        except Exception:
            outcome = "error"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.finish(kind, outcome, res, t0)
            if rid:
                tasks = self._by_rid[rid]
                tasks.discard(task)
                if not tasks:
                    del self._by_rid[rid]

    async def _collect(self, res: _Result, start) -> None:
        async with aclosing(start()) as outputs:
            async for out in outputs:
                res.add(out)

    async def _stream(self, request, fmt: _Formatter, res: _Result, start) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        try:
            async with aclosing(start()) as outputs:
                async for out in outputs:
                    res.add(out)
                    if not resp.prepared:  # prepared on the first output, so an engine error can still be a 4xx
                        await resp.prepare(request)
                    await resp.write(fmt.chunk(out, res))
                if not resp.prepared:
                    await resp.prepare(request)
                await resp.write(fmt.tail(res))
        except ApiError as exc:
            if not resp.prepared:
                raise
            res.failed = True
            await resp.write(P.sse(data=json_bytes(exc.to_dict())))
        except ConnectionResetError:
            return resp  # the client left; aclosing already freed the engine request
        await resp.write_eof()
        return resp

    @property
    def role(self) -> str:
        """mixed, prefill or decode: what the instance serves (its ranks report it)."""
        return self.engine.stats().get("role", "mixed")

    def _pairing(self, req, params):
        """(the request's Pairing or None, its sampling parameters): a prefill or decode worker serves its half of a
        request that carries SGLang's bootstrap fields (the prefill half stops at the first token); a mixed one
        serves the whole request and ignores them."""
        fields, role = req.bootstrap(), self.role
        if role == "mixed":
            return None, params
        if fields is None and role == "decode" and self.engine.stats().get("disaggregation_local_prefill"):
            return None, params           # a P/D router's decider chose local prefill: served as on a mixed one
        if fields is None:
            raise ApiError(400, f"this worker serves the {role} role of disaggregated serving: a request needs "
                                f"bootstrap_host, bootstrap_port and bootstrap_room (send it through a P/D router, "
                                f"e.g. sglang-router --pd-disaggregation; a decode worker started with "
                                f"engine.disaggregation_local_prefill=true serves one without them)",
                                param="bootstrap_room")
        host, port, room = fields
        if role == "prefill":
            params = dataclasses.replace(params, max_new_tokens=1)
        return Pairing(room, host, port), params

    async def _generate(self, prompt: str, params, field: str, dp_rank: int | None = None, pairing=None
                        ) -> AsyncIterator[GenerateOutput]:
        """The engine's iterator, with its input errors turned into a 400 and other failures into a 500. `dp_rank`:
        the DP group the request names (the engine refuses one outside its groups: a 400)."""
        try:
            async with aclosing(generate(self.engine, prompt, params, dp_rank, pairing)) as outputs:
                async for out in outputs:
                    yield out
        except ValueError as exc:  # the engine's way of rejecting a request (e.g. prompt longer than the KV pool)
            raise ApiError(400, f"{field}: {exc}", param=field) from exc
        except Exception as exc:  # as an ApiError it can still end a started stream with an error event
            log.exception("engine failed on a request")
            raise ApiError(500, f"engine failed: {type(exc).__name__}: {exc}") from exc

    # --------------------------------------------------------------- control endpoints

    async def handle_abort(self, request: web.Request) -> web.Response:
        rid = parse_body(P.AbortRequest, await request.read()).rid
        tasks = self._by_rid.get(rid, ())
        for t in tasks:
            t.cancel()  # its aclosing() frees the request in the engine
        return web.json_response({"success": True, "aborted": len(tasks)})

    async def handle_health(self, request: web.Request) -> web.Response:
        error = self.engine.error  # set once the instance failed
        if error is not None:
            return web.json_response({"status": "unhealthy", "error": error}, status=503)
        return web.json_response({"status": "ok"})

    async def handle_server_info(self, request: web.Request) -> web.Response:
        info = self.engine.stats()
        info.setdefault("model_name", self.model_name)
        info["http_in_flight"] = self.in_flight
        info["server_process_cpu_s"] = time.process_time()   # this process's CPU: the HTTP side, and a one-rank engine
        return web.json_response({**info, **self.extra_info})

    async def handle_sglang_server_info(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /server_info`` (what sglang-router reads of a P/D worker): /get_server_info's figures with
        SGLang's ``disaggregation_mode`` (null, prefill or decode) and the prefill's bootstrap port."""
        info = {**self.engine.stats(), **self.extra_info, "http_in_flight": self.in_flight}
        info.setdefault("model_name", self.model_name)
        role = info.get("role", "mixed")
        info["disaggregation_mode"] = "null" if role == "mixed" else role
        return web.json_response(info)

    async def handle_model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /model_info`` (``/get_model_info``)."""
        return web.json_response({"model_path": self.model_name, "tokenizer_path": None, "is_generation": True})

    async def handle_get_load(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /get_load`` (what sglang-router's power_of_two polls): one object per DP rank; num_tokens is
        the KV the requests hold beyond the prefixes they share with the cache."""
        info = self.engine.stats()
        running, queued = info.get("running_requests", 0), info.get("queued_requests", 0)
        tokens = max(info.get("kv_used_tokens", 0) - info.get("cache_tokens", 0), 0)
        return web.json_response([{"dp_rank": 0, "num_reqs": running + queued, "num_waiting_reqs": queued,
                                   "num_tokens": tokens}])

    async def handle_metrics(self, request: web.Request) -> web.Response:
        info = self.engine.stats()
        for gauge, key in ((self.metrics.running, "running_requests"), (self.metrics.queued, "queued_requests")):
            if key in info:  # empty until the instance first reports
                gauge.set(info[key])
        return metrics_response(self.metrics.registry)

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        if not await self.engine.flush_cache():
            raise ApiError(409, "cache not flushed: the engine has requests in flight; retry when it is idle")
        return web.json_response({"success": True, "message": "cache flushed"})

    async def handle_models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": P.now_s(), "owned_by": "servelab"}
        return web.json_response({"object": "list", "data": [card]})


WORKER_KEY = web.AppKey("worker", WorkerServer)


def create_worker_app(engine: EngineHandle, *, model_name: str = "servelab",
                      client_max_size: int = DEFAULT_CLIENT_MAX_SIZE, extra_info: dict | None = None) -> web.Application:
    server = WorkerServer(engine, model_name, extra_info)
    app = make_app(client_max_size)
    app[WORKER_KEY] = server
    app.router.add_post("/generate", partial(server.handle, kind="generate"))
    app.router.add_post("/v1/completions", partial(server.handle, kind="completions"))
    app.router.add_post("/v1/chat/completions", partial(server.handle, kind="chat"))
    app.router.add_get("/health", server.handle_health)
    app.router.add_get("/get_server_info", server.handle_server_info)
    app.router.add_get("/server_info", server.handle_sglang_server_info)
    app.router.add_get("/model_info", server.handle_model_info)
    app.router.add_get("/get_model_info", server.handle_model_info)
    app.router.add_get("/get_load", server.handle_get_load)
    app.router.add_get("/metrics", server.handle_metrics)
    app.router.add_post("/flush_cache", server.handle_flush_cache)
    app.router.add_post("/abort_request", server.handle_abort)
    app.router.add_get("/v1/models", server.handle_models)
    return app


async def serve_worker(engine: EngineHandle, host: str = "127.0.0.1", port: int = 30001, *,
                       model_name: str = "servelab", client_max_size: int = DEFAULT_CLIENT_MAX_SIZE) -> None:
    """Serve the worker API on host:port until the calling task is cancelled (the engine runs in the same loop)."""
    await serve_forever(create_worker_app(engine, model_name=model_name, client_max_size=client_max_size), host, port)
