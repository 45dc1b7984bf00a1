"""The router service: one HTTP front for many workers, choosing each request's worker with a routing policy.

It speaks the workers' client APIs (native ``/generate``, OpenAI completions and chat) and forwards with one pooled
``aiohttp.ClientSession``. Streams pass through chunk by chunk. Reliability, beyond SGLang router 0.1.0:

- periodic ``GET /health`` of every worker; only healthy workers are routed to, and workers that are not up at start
  join when their first check passes;
- connection errors, timeouts and 408/429/5xx are retried on a *different* worker (when there is one), at most
  ``max_retries`` times, with exponential backoff and jitter; other 4xx are the client's fault and pass straight back;
- a worker silent for ``request_timeout_s`` (no answer, or no next stream chunk) is given up on
  (``health.SilenceTimeout``: one periodic sweep rather than a timer per request);
- a per-worker circuit breaker (``health.CircuitBreaker``) counts consecutive connection errors, timeouts and 5xx;
- the policy's in-flight count is released exactly once per attempt, in a ``finally`` (success, error, client
  disconnect, broken stream);
- a stream that already sent bytes cannot be retried: it ends with an SSE error event;
- ``remove_worker`` drains: no new requests, then waits for the worker's in-flight ones before forgetting it.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from functools import partial

import aiohttp
from aiohttp import web

from framework.routing import RoutingConfig
from framework.serving import protocol as P
from framework.serving.errors import ApiError, json_bytes, parse_body
from framework.serving.health import (CircuitBreaker, SilenceTimeout, WorkerState, describe_error,
                                      normalize_worker_url)
from framework.serving.router_stats import RouterStats, router_registry
from framework.serving.server_base import (make_app, metrics_response, serve_forever,
                                           tune_gc_for_serving)

log = logging.getLogger(__name__)

ROUTES = {"/generate": P.GenerateRouting, "/v1/completions": P.CompletionRouting,
          "/v1/chat/completions": P.ChatRouting}
FORWARDED_REQUEST_HEADERS = ("Content-Type", "Authorization", "X-Request-Id")
WORKER_HEADER = "X-Servelab-Worker"  # names the worker that answered (debugging, tests)


@dataclass
class RouterServiceConfig(RoutingConfig):
    """The settings the service runs with: the `router.*` keys of framework/routing.py's RoutingConfig, checked."""

    def __post_init__(self) -> None:
        positive = ("health_check_interval_secs", "health_check_timeout_secs", "request_timeout_s",
                    "connect_timeout_s", "drain_timeout_secs", "maintain_interval_secs", "client_max_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"router.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_retries", "retry_backoff_base_s", "retry_backoff_max_s", "breaker_cooldown_secs"):
            if getattr(self, name) < 0:
                raise ValueError(f"router.{name} must be >= 0, got {getattr(self, name)}")
        if self.breaker_failure_threshold < 1:
            raise ValueError(f"router.breaker_failure_threshold must be >= 1, got {self.breaker_failure_threshold}")


@dataclass
class _Failed:
    """A retriable attempt: the worker's own error response (status + body) or a transport error (status None)."""
    message: str
    status: int | None = None
    body: bytes = b""
    content_type: str = "application/json"
    timeout: bool = False

    def response(self, attempts: int) -> web.Response:
        if self.status is not None:
            return web.Response(status=self.status, body=self.body, headers={"Content-Type": self.content_type})
        status = 504 if self.timeout else 502
        return ApiError(status, f"{attempts} attempt(s) failed; last: {self.message}").response()


@dataclass
class _Attempt:
    worker: WorkerState
    verdict: str | None = None  # for the breaker: "ok" | "fail" | None (tells nothing about the worker)
    outcome: str | None = None  # for the stats, when a relayed stream ended badly: broken_stream | client_disconnect


class Router:
    def __init__(self, policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None, seed: int = 0):
        self.policy, self.cfg = policy, cfg or RouterServiceConfig()
        self.workers: dict[str, WorkerState] = {}
        self.stats = RouterStats()
        self.registry = router_registry(self.stats, lambda: self.workers.values())
        self.session: aiohttp.ClientSession | None = None
        self._rng = random.Random(seed)
        self._tasks: list[asyncio.Task] = []
        # Built once. No total: a stream may run for as long as its worker keeps talking; the silence between the
        # worker's bytes is bounded by self._silence (request_timeout_s), not by aiohttp's per-request sock_read timer.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        self._silence = SilenceTimeout(self.cfg.request_timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_secs)
        self._control_timeout = aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_secs * 5)
        for url in worker_urls:
            self._register(normalize_worker_url(url))

    # ------------------------------------------------------------------ lifecycle

    async def start(self, app: web.Application | None = None) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)  # no pool cap: the policy bounds the load
        # DummyCookieJar: a proxy must not replay one client's cookies (set by a worker) on other clients' requests
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                             cookie_jar=aiohttp.DummyCookieJar())
        await self.check_health()  # whoever is up now takes traffic at once; the rest join on a later check
        self._tasks = [asyncio.create_task(self._every(self.cfg.health_check_interval_secs, self.check_health)),
                       asyncio.create_task(self._every(self.cfg.maintain_interval_secs, self._maintain)),
                       asyncio.create_task(self._every(self._silence.tick_s, self._sweep_silent))]

    async def close(self, app: web.Application | None = None) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _every(self, period: float, fn) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await fn()
            except Exception:  # a periodic job must never die
                log.exception("router periodic job %s failed", getattr(fn, "__name__", fn))

    async def _maintain(self) -> None:
        self.policy.maintain(time.monotonic())

    async def _sweep_silent(self) -> None:
        self._silence.sweep(time.monotonic())

    # ------------------------------------------------------------------ workers

    def _register(self, url: str) -> WorkerState:
        if url in self.workers:
            raise ApiError(409, f"url: worker {url} is already registered", param="url")
        state = WorkerState(url, CircuitBreaker(self.cfg.breaker_failure_threshold, self.cfg.breaker_cooldown_secs))
        self.workers[url] = state
        if url not in self.policy.loads:
            self.policy.add_worker(url)
        return state

    async def _check(self, w: WorkerState) -> None:
        try:
            async with self.session.get(w.url + "/health", timeout=self._health_timeout) as resp:
                await resp.read()
                ok, error = resp.status == 200, None if resp.status == 200 else f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, error = False, describe_error(exc)
        if ok != w.healthy:
            log.info("worker %s is now %s%s", w.url, "healthy" if ok else "unhealthy", f" ({error})" if error else "")
        w.healthy, w.last_health_error = ok, error

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def add_worker(self, url: str) -> WorkerState:
        state = self._register(normalize_worker_url(url))
        await self._check(state)
        return state

    async def remove_worker(self, url: str) -> dict:
        url = normalize_worker_url(url)
        w = self.workers.get(url)
        if w is None:
            raise ApiError(404, f"url: unknown worker {url}; workers: {sorted(self.workers)}", param="url")
        if w.draining:
            raise ApiError(409, f"url: worker {url} is already being removed", param="url")
        w.draining = True  # no new requests from here on
        drained_from = w.in_flight
        try:
            await asyncio.wait_for(w.idle.wait(), self.cfg.drain_timeout_secs)
        except TimeoutError:
            log.warning("worker %s still had %d requests after %.0fs of draining", url, w.in_flight,
                        self.cfg.drain_timeout_secs)
        del self.workers[url]
        self.policy.remove_worker(url)
        return {"removed": url, "drained_requests": drained_from, "abandoned_requests": w.in_flight}

    # ------------------------------------------------------------------ forwarding

    def _pick(self, text: str, tried: set[str]) -> WorkerState:
        now = time.monotonic()
        candidates = [u for u, w in self.workers.items() if w.routable(now)]
        if tried:  # a retry: another worker when there is one
            candidates = [u for u in candidates if u not in tried] or candidates
        if not candidates:
            raise ApiError(503, f"no healthy worker available ({len(self.workers)} registered: "
                                f"{[w.describe() for w in self.workers.values()]})")
        t0 = time.perf_counter()
        url = self.policy.select(text, candidates)
        self.stats.decision(self.policy.last_decision, time.perf_counter() - t0)
        w = self.workers[url]
        w.begin(now)
        return w

    def _backoff_s(self, retry: int) -> float:
        d = min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_base_s * 2 ** (retry - 1))
        return d / 2 + self._rng.random() * d / 2

    async def forward(self, request: web.Request, route: str) -> web.StreamResponse:
        tried: set[str] = set()
        failed: _Failed | None = None
        outcome = "invalid_request"
        try:
            raw = await request.read()
            text = parse_body(ROUTES[route], raw).routing_text()
            headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
            outcome = "client_disconnect"  # until an answer is ready
            for attempt in range(self.cfg.max_retries + 1):
                if attempt:
                    self.stats.retries += 1
                    await asyncio.sleep(self._backoff_s(attempt))
                try:
                    w = self._pick(text, tried)
                except ApiError:
                    if failed is None:
                        outcome = "no_worker"
                        raise
                    break  # nobody left to retry on: answer with the last failure
                tried.add(w.url)
                att = _Attempt(w)
                result = await self._attempt(request, att, route, raw, headers)
                if not isinstance(result, _Failed):
                    outcome = att.outcome or ("ok" if result.status < 400 else "client_error")
                    return result
                failed = result
            outcome = "upstream_error"
            return failed.response(len(tried))
        finally:
            self.stats.outcomes[route, outcome] += 1

    async def _attempt(self, request: web.Request, att: _Attempt, route: str, raw: bytes,
                       headers: dict) -> web.StreamResponse | _Failed:
        """One try on one worker. Returns the final response, or ``_Failed`` when another worker may be tried."""
        w = att.worker
        up = None
        try:
            with self._silence:  # the response head, then the whole body unless it is a stream
                up = await self.session.post(w.endpoint(route), data=raw, headers=headers)
                content_type = up.headers.get("Content-Type", "application/json")
                retriable = up.status in (408, 429) or up.status >= 500
                relay = not retriable and (content_type.startswith("text/event-stream") or up.content_length is None)
                body = b"" if relay else await up.read()  # buffered: a failure mid-body is still retriable
            if retriable:
                att.verdict = "fail" if up.status >= 500 else None  # 408/429: busy, not broken
                return _Failed(f"{w.url} answered {up.status}", up.status, body, content_type)
            if relay:
                return await self._relay(request, up, att)
            att.verdict = "ok"  # a 4xx is the client's fault: it counts in the worker's favour
            return web.Response(status=up.status, body=body,
                                headers={"Content-Type": content_type, WORKER_HEADER: w.url})
        except (aiohttp.ClientError, TimeoutError) as exc:
            att.verdict = "fail"
            if isinstance(exc, aiohttp.ClientConnectorError):
                w.healthy = False  # refused/unreachable: skip it until a health check passes again
            return _Failed(f"{w.url}: {describe_error(exc)}", timeout=isinstance(exc, TimeoutError))
        finally:
            if up is not None:
                up.release()  # the connection goes back to the pool when the body was read to the end
            self.policy.on_request_done(w.url)
            w.end()
            if att.verdict == "ok":
                w.breaker.record_success()
            elif att.verdict == "fail":
                w.failures += 1
                w.breaker.record_failure(time.monotonic())
            else:
                w.breaker.record_neutral()

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse, att: _Attempt) -> web.StreamResponse:
        """Pass a stream through as it arrives. Nothing is sent before the worker's first chunk, so a worker that
        fails before it is still retried; after it, a broken stream ends with an SSE error event. Only the waits on
        the worker count towards its silence: a slow client holding up ``resp.write`` does not."""
        w = att.worker
        with self._silence:
            chunk = await up.content.readany()
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/octet-stream"),
            "Cache-Control": "no-cache", WORKER_HEADER: w.url})
        try:
            await resp.prepare(request)
            while chunk:
                await resp.write(chunk)
                try:
                    with self._silence:
                        chunk = await up.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    att.verdict, att.outcome = "fail", "broken_stream"
                    msg = f"worker {w.url} broke the stream: {describe_error(exc)}"
                    await resp.write(P.sse(data=json_bytes(ApiError(502, msg).to_dict())))
                    await resp.write_eof()
                    return resp
            att.verdict = "ok"
            await resp.write_eof()
        except ConnectionResetError:
            att.outcome = "client_disconnect"
            up.close()  # the client left: drop the worker connection so the worker aborts the generation
        except asyncio.CancelledError:
            up.close()
            raise
        return resp

    # ------------------------------------------------------------------ control endpoints

    async def handle_add_worker(self, request: web.Request) -> web.Response:
        w = await self.add_worker(request.query.get("url"))
        return web.json_response({"added": w.url, "healthy": w.healthy, "workers": sorted(self.workers)})

    async def handle_remove_worker(self, request: web.Request) -> web.Response:
        return web.json_response(await self.remove_worker(request.query.get("url")))

    async def handle_list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": list(self.workers), "workers": [w.describe() for w in self.workers.values()]})

    async def handle_health(self, request: web.Request) -> web.Response:
        healthy = sum(w.healthy for w in self.workers.values())
        return web.json_response({"status": "ok", "workers": len(self.workers), "healthy_workers": healthy})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def handle_router_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.snapshot(self.workers.values()))

    async def handle_reset_router_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return web.json_response({"reset": True})

    async def _fan_out(self, method: str, path: str) -> dict[str, tuple[int | None, object]]:
        """``method path`` on every healthy worker at once -> {url: (status or None, JSON body or error text)}."""
        async def one(url: str):
            try:
                async with self.session.request(method, url + path, timeout=self._control_timeout) as resp:
                    return url, (resp.status, await resp.json(content_type=None))
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return url, (None, describe_error(exc))
        urls = [u for u, w in self.workers.items() if w.healthy and not w.draining]
        return dict(await asyncio.gather(*(one(u) for u in urls)))

    async def handle_server_info(self, request: web.Request) -> web.Response:
        answers = await self._fan_out("GET", "/get_server_info")
        per_worker = {u: body if status == 200 else {"error": body} for u, (status, body) in answers.items()}
        totals: dict[str, float] = {}
        for info in per_worker.values():
            for k, v in info.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        return web.json_response({"router": {"workers": len(self.workers), "healthy_workers": len(answers)},
                                  "totals": totals, "workers": per_worker})

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        answers = await self._fan_out("POST", "/flush_cache")
        failed = {u: (status, body) for u, (status, body) in answers.items() if status != 200}
        if failed:
            raise ApiError(502, f"flush_cache failed on {len(failed)} of {len(answers)} workers: {failed}")
        return web.json_response({"success": True, "workers": sorted(answers)})

    async def handle_models(self, request: web.Request) -> web.Response:
        answers = await self._fan_out("GET", "/v1/models")
        cards = {c["id"]: c for status, body in answers.values() if status == 200 for c in body.get("data", [])}
        return web.json_response({"object": "list", "data": list(cards.values())})


ROUTER_KEY = web.AppKey("router", Router)


def create_router_app(policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None,
                      seed: int = 0) -> web.Application:
    """The router as an aiohttp app; ``app[ROUTER_KEY]`` is its ``Router`` (workers, stats, policy)."""
    router = Router(policy, worker_urls, cfg, seed)
    app = make_app(router.cfg.client_max_size)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    for path in ROUTES:
        app.router.add_post(path, partial(router.forward, route=path))
    app.router.add_post("/add_worker", router.handle_add_worker)
    app.router.add_post("/remove_worker", router.handle_remove_worker)
    app.router.add_get("/list_workers", router.handle_list_workers)
    app.router.add_get("/health", router.handle_health)
    app.router.add_get("/metrics", router.handle_metrics)
    app.router.add_get("/get_server_info", router.handle_server_info)
    app.router.add_get("/router_stats", router.handle_router_stats)
    app.router.add_post("/router_stats/reset", router.handle_reset_router_stats)
    app.router.add_post("/flush_cache", router.handle_flush_cache)
    app.router.add_get("/v1/models", router.handle_models)
    return app


async def serve_router(policy, worker_urls: list[str], cfg: RouterServiceConfig | None = None, seed: int = 0) -> None:
    """Serve the router on ``cfg.host:cfg.port`` until the calling task is cancelled. Meant as a process's main
    task: it tunes the process's garbage collector (server_base.tune_gc_for_serving)."""
    app = create_router_app(policy, worker_urls, cfg, seed)
    tune_gc_for_serving()
    await serve_forever(app, app[ROUTER_KEY].cfg.host, app[ROUTER_KEY].cfg.port)
