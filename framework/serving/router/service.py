"""The router service: one HTTP front for many workers, choosing each request's worker with a routing policy.
An asyncio shell over the router core (framework/routing/core.py), which decides and counts: this module forwards.

It speaks the workers' client APIs (native ``/generate``, OpenAI completions and chat, every prompt shape SGLang and
vLLM take) and forwards with one pooled ``aiohttp.ClientSession``; headers pass through both ways (hop-by-hop ones
removed) and streams chunk by chunk. Reliability, beyond SGLang router 0.1.0 (docs/fidelity.md, "Router"):

- periodic ``GET /health`` of every worker; only healthy workers are routed to, and workers that are not up at start
  join when their first check passes (one that was unreachable comes back with its cache estimate dropped);
- per client request, a first-byte deadline and a total deadline (``first_byte_timeout_s``, ``total_timeout_s``);
  per attempt, a streaming worker silent for ``request_timeout_s`` is given up on (``health.WaitTimer``: one periodic
  sweep rather than a timer per request); a request it had received goes elsewhere only once it confirms the abort
  (``POST /abort_request``), or is found dead -- a hung or merely slow worker never causes a second generation;
- connection errors, confirmed aborts and 408/429/5xx are retried, at most ``max_retries`` times, each retry counted
  when it is sent, after an exponential backoff with jitter: on a worker not tried yet when there is one, else on
  the same worker for 429/503 only; a Retry-After is honoured (the worker gets no new request until it passes);
  other 4xx are the client's fault and pass straight back; the last failure goes back with its headers;
- a per-worker circuit breaker (framework/routing/workers.py) counts consecutive connection errors and 5xx other
  than 503/504; timeouts, 408, 429 and 503 tell that a worker is busy, not broken;
- the in-flight count is released exactly once per attempt (``RouterCore.release``, in a ``finally``), on the worker
  state the attempt went to (a URL removed and added again is a new worker); a failed attempt takes back the cache
  credit the policy gave the worker, and ``/flush_cache`` drops the workers' cache estimates;
- a stream that already sent bytes cannot be retried: it ends with an SSE error event;
- ``remove_worker`` drains (no new requests, then waits for the worker's in-flight ones) in a task of its own
  (control.py), so a caller that gives up does not leave the worker half-removed; removing again joins the same
  drain.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from framework.contracts.routing import RequestView
from framework.routing.core import BROKEN_STREAM, CLIENT_DISCONNECT, FAIL, OK, Attempt, RouterCore
from framework.routing.workers import WorkerState
from framework.serving.http import protocol as P
from framework.serving.http.errors import ApiError, json_bytes, parse_body
from framework.serving.http.proxy import (NOT_FORWARDED, NOT_RETURNED, REQUEST_ID_HEADER, RETRY_SAME_WORKER, ROUTE_HEADER,
                                          WORKER_HEADER, Failed, pass_headers, retry_after_s, route_header)
from framework.serving.http.server_base import make_app, serve_forever, tune_gc_for_serving
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.control import ControlEndpoints, Membership
from framework.serving.router.events import USAGE_TAIL, WorkerEvents, parse_usage
from framework.serving.router.health import (WaitTimer, WorkerTimeout, describe_error, endpoint, normalize_worker_url,
                                             run_every)
from framework.serving.router.stats import router_registry

log = logging.getLogger(__name__)

ROUTES = {"/generate": P.GenerateRouting, "/v1/completions": P.CompletionRouting,
          "/v1/chat/completions": P.ChatRouting}


@dataclass(slots=True)
class _Call:
    """One client request, over all its attempts."""
    route: str
    raw: bytes
    request: str | RequestView  # what the policy routes on: the text, or a view with the client's token ids
    stream: bool
    headers: CIMultiDict  # what goes to the worker
    rid: str  # its X-Request-Id: what /abort_request names
    first_byte_by: float  # time.monotonic() deadlines
    done_by: float
    answered: bool = False  # bytes went to the client: no other attempt can be made
    tried: list[WorkerState] = field(default_factory=list)


def answer_headers(up: aiohttp.ClientResponse, att: Attempt) -> CIMultiDict:
    """The worker's end-to-end headers, with which worker answered and the decision that sent the request there."""
    headers = pass_headers(up.headers, NOT_RETURNED)
    headers[WORKER_HEADER] = att.worker.url
    headers[ROUTE_HEADER] = route_header(att.decision)
    return headers


def _wake(released: list[Attempt]) -> None:
    """Held attempts the core let go: their requests go on (``Router._hold``)."""
    for att in released:
        if not att.ref.done():
            att.ref.set_result(None)


class Router:
    """``core`` decides and counts (its ``clock``: the policy's, time.monotonic unless given); the client's deadlines
    and the waits on workers run on time.monotonic."""

    def __init__(self, policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None, seed: int = 0,
                 clock: Callable[[], float] | None = None):
        self.policy, self.cfg = policy, cfg or RouterServiceConfig()
        c = self.cfg
        c.validate()
        self.core = RouterCore(policy, clock, c.breaker_failure_threshold, c.breaker_cooldown_secs)
        self.workers, self.stats = self.core.workers, self.core.stats
        self.registry = router_registry(self.stats, self.workers.values)
        self.session: aiohttp.ClientSession | None = None  # made at start: the others get it from _session
        self.events = WorkerEvents(self.core, c, self._session, _wake)  # what the policy subscribed to
        self.membership = Membership(self.core, c, self.events, self._session)
        self.control = ControlEndpoints(self.core, self.membership, self.events, self.registry, self._session)
        self._removals = self.membership.removals
        self._rng = random.Random(seed)
        self._tasks: list[asyncio.Task] = []
        # Built once. No total: a stream may run for as long as its worker keeps talking; waits on a worker are
        # bounded by self._timer (silence and the client's deadlines), not by aiohttp's per-request timers.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout_s)
        tick = min(1.0, min(c.request_timeout_s, c.first_byte_timeout_s, c.total_timeout_s) / 10)
        self._timer = WaitTimer(c.request_timeout_s, tick)
        self._first_byte_name = f"router.first_byte_timeout_s={c.first_byte_timeout_s:g}"
        self._total_name = f"router.total_timeout_s={c.total_timeout_s:g}"
        self._abort_timeout = aiohttp.ClientTimeout(total=c.abort_timeout_s)
        for url in worker_urls:
            self.membership.register(normalize_worker_url(url))

    # ------------------------------------------------------------------ lifecycle

    async def start(self, app: web.Application | None = None) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)  # no pool cap: the policy bounds the load
        # DummyCookieJar: a proxy must not replay one client's cookies (set by a worker) on other clients' requests.
        # Bodies pass as they are (no decompression) and only the client's own headers go out (no aiohttp defaults).
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False,
                                             cookie_jar=aiohttp.DummyCookieJar(),
                                             skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))
        await self.check_health()  # whoever is up now takes traffic at once; the rest join on a later check
        self._tasks = [asyncio.create_task(run_every(self.cfg.health_check_interval_secs, self.check_health)),
                       asyncio.create_task(run_every(self.cfg.maintain_interval_secs, self._maintain)),
                       asyncio.create_task(run_every(self._timer.tick_s, self._sweep)), *self.events.start()]

    async def close(self, app: web.Application | None = None) -> None:
        tasks = self._tasks + list(self._removals.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.events.close()
        if self.session is not None:
            await self.session.close()

    def _session(self) -> aiohttp.ClientSession:
        return self.session

    async def check_health(self) -> None:
        await self.membership.check_health()

    async def add_worker(self, url: str) -> WorkerState:
        return await self.membership.add_worker(url)

    async def remove_worker(self, url: str) -> dict:
        return await self.membership.remove_worker(url)

    async def _maintain(self) -> None:
        self.core.maintain()

    async def _sweep(self) -> None:
        self._timer.sweep(time.monotonic())

    # ------------------------------------------------------------------ forwarding

    def _backoff_s(self, retry: int) -> float:
        d = min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_base_s * 2 ** (retry - 1))
        return d / 2 + self._rng.random() * d / 2

    def _no_worker(self) -> ApiError:
        now = self.core.clock()
        parked = [w.not_before - now for w in self.workers.values()
                  if w.healthy and not w.draining and w.not_before > now]
        return ApiError(503, f"no healthy worker available ({len(self.workers)} registered: "
                             f"{[w.describe(now) for w in self.workers.values()]})",
                        headers={"Retry-After": str(math.ceil(min(parked)))} if parked else None)

    def _next(self, call: _Call, failed: Failed | None) -> tuple[list[WorkerState], float] | None:
        """Where the next attempt may go and how long to wait first; None when no attempt is left to make."""
        routable = self.core.routable(self.core.clock())
        if failed is None:
            if not routable:
                raise self._no_worker()
            return routable, 0.0
        if not failed.retriable or len(call.tried) > self.cfg.max_retries:
            return None
        backoff = self._backoff_s(len(call.tried))
        fresh = [w for w in routable if w not in call.tried]
        if fresh:
            return fresh, backoff
        w = failed.worker
        if failed.status in RETRY_SAME_WORKER and self.core.is_current(w):
            return [w], max(backoff, failed.retry_after or 0.0)
        return None

    def _deadline(self, call: _Call) -> tuple[float, str, bool]:
        """The limits of the call's next wait on a worker, for ``self._timer``."""
        if not call.answered and call.first_byte_by < call.done_by:
            return call.first_byte_by, self._first_byte_name, call.stream
        return call.done_by, self._total_name, call.stream

    async def forward(self, request: web.Request, route: str) -> web.StreamResponse:
        outcome = "invalid_request"
        try:
            raw = await request.read()
            view = parse_body(ROUTES[route], raw)
            text, ids = view.routing_text(), view.token_ids()
            headers = pass_headers(request.headers, NOT_FORWARDED)
            rid = headers.get(REQUEST_ID_HEADER) or headers.setdefault(REQUEST_ID_HEADER, uuid.uuid4().hex)
            headers.setdefault("Content-Type", "application/json")
            now = time.monotonic()
            call = _Call(route, raw, text if ids is None else RequestView(text, ids), bool(view.stream), headers, rid,
                         now + self.cfg.first_byte_timeout_s, now + self.cfg.total_timeout_s)
            outcome = "no_worker"
            failed = None
            while (plan := self._next(call, failed)) is not None:
                outcome = CLIENT_DISCONNECT  # until an answer is ready
                pool, delay = plan
                if failed is not None:
                    if time.monotonic() + delay >= self._deadline(call)[0]:
                        break  # the client's deadline comes first: answer with the last failure
                    await asyncio.sleep(delay)
                    now = self.core.clock()
                    pool = [w for w in pool if self.core.is_current(w) and w.routable(max(now, w.not_before))]
                    if not pool:
                        break
                att = self.core.dispatch(call.request, pool, retry=bool(call.tried))
                call.tried.append(att.worker)
                try:
                    await self._hold(att, self._deadline(call)[0])
                except BaseException:  # the client went away while it was held: it was never sent
                    self.core.release(att)
                    raise
                result = await self._attempt(request, call, att)
                if not isinstance(result, Failed):
                    outcome = att.outcome or ("ok" if result.status < 400 else "client_error")
                    return result
                failed = result
            outcome = "timeout" if failed.timeout else "upstream_error"
            return failed.response(len(call.tried))
        finally:
            self.stats.outcomes[route, outcome] += 1

    async def _hold(self, att: Attempt, deadline: float) -> None:
        """Wait while the core holds the request (its prefix is still being prefilled on the worker): until a batch
        of that worker's events lets it go (``_wake``), the hold runs out, or the client's ``deadline`` (monotonic)."""
        left = self.core.hold(att, deadline - time.monotonic())
        if left > 0:
            att.ref = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(att.ref, left)
            except TimeoutError:
                self.core.hold_over(att)

    async def _attempt(self, request: web.Request, call: _Call, att: Attempt) -> web.StreamResponse | Failed:
        """One try on one worker. Returns the final response, or ``Failed``."""
        w = att.worker
        up = None
        try:
            with self._timer(*self._deadline(call)):  # the response head, then the whole body unless it streams
                up = await self.session.post(endpoint(w, call.route), data=call.raw, headers=call.headers)
                status = up.status
                retriable = status in (408, 429) or status >= 500
                relay = not retriable and (up.content_type == "text/event-stream" or up.content_length is None)
                body = b"" if relay else await up.read()  # buffered: a failure mid-body is still retriable
            if retriable:
                att.verdict = FAIL if status >= 500 and status not in (503, 504) else None  # else busy, not broken
                wait = retry_after_s(up.headers.get("Retry-After")) if status in RETRY_SAME_WORKER else None
                if wait:
                    w.not_before = max(w.not_before, self.core.clock() + wait)
                return Failed(w, f"{w.url} answered {status}", status, body, pass_headers(up.headers, NOT_RETURNED),
                              retry_after=wait)
            if relay:
                return await self._relay(request, call, up, att)
            att.verdict, att.served = OK, status < 400  # a 4xx is the client's fault: it counts for the worker
            if att.served and self.core.wants_usage:
                att.usage = parse_usage(body)
            return web.Response(status=status, body=body, headers=answer_headers(up, att))
        except WorkerTimeout as exc:  # busy or hung: not a breaker failure
            if not exc.silence:
                return Failed(w, f"{w.url}: {exc}", timeout=True, retriable=False)
            confirmed = await self._abort(w, call.rid)
            return Failed(w, f"{w.url}: {exc}; " + ("it confirmed it dropped the request" if confirmed else
                                                     "it did not confirm it dropped the request, which therefore "
                                                     "was not sent to another worker"),
                          timeout=True, retriable=confirmed)
        except (aiohttp.ClientError, OSError) as exc:
            timeout = isinstance(exc, TimeoutError)  # a connection that did not open in connect_timeout_s
            att.verdict = None if timeout else FAIL
            if isinstance(exc, aiohttp.ClientConnectorError):
                w.healthy, w.unreachable = False, True  # skip it until a health check passes again
            return Failed(w, f"{w.url}: {describe_error(exc)}", timeout=timeout)
        finally:
            if up is not None:
                up.release()  # the connection goes back to the pool when the body was read to the end
            self.core.release(att)

    async def _abort(self, w: WorkerState, rid: str) -> bool:
        """Ask a silent worker to drop request ``rid``; True when it confirms (SGLang-style ``/abort_request``
        answered with a count, as servelab's worker does) or when nothing listens there any more."""
        try:
            async with self.session.post(w.url + "/abort_request", json={"rid": rid},
                                         timeout=self._abort_timeout) as resp:
                body = await resp.json(content_type=None)
                return resp.status == 200 and isinstance(body, dict) and type(body.get("aborted")) is int
        except aiohttp.ClientConnectorError:
            w.healthy, w.unreachable = False, True
            return True
        except (aiohttp.ClientError, OSError, ValueError):
            return False

    async def _relay(self, request: web.Request, call: _Call, up: aiohttp.ClientResponse,
                     att: Attempt) -> web.StreamResponse:
        """Pass a stream through as it arrives. Nothing is sent before the worker's first chunk, so a worker that
        fails before it is still retried; after it, a broken stream ends with an SSE error event. Only the waits on
        the worker count towards its silence: a slow client holding up ``resp.write`` does not."""
        w = att.worker
        with self._timer(*self._deadline(call)):
            chunk = await up.content.readany()
        resp = web.StreamResponse(status=up.status, headers=answer_headers(up, att))
        att.served = up.status < 400
        tail = b"" if self.core.wants_usage else None  # the stream's end, for the usage in its last event
        try:
            await resp.prepare(request)
            call.answered = True
            while chunk:
                if tail is not None:
                    tail = (tail + chunk)[-USAGE_TAIL:]
                await resp.write(chunk)
                try:
                    with self._timer(*self._deadline(call)):
                        chunk = await up.content.readany()
                except (aiohttp.ClientError, OSError) as exc:
                    att.verdict = None if isinstance(exc, TimeoutError) else FAIL
                    att.outcome = BROKEN_STREAM
                    msg = f"worker {w.url} broke the stream: {describe_error(exc)}"
                    await resp.write(P.sse(data=json_bytes(ApiError(502, msg).to_dict())))
                    await resp.write_eof()
                    return resp
            att.verdict = OK
            await resp.write_eof()
        except ConnectionResetError:
            att.outcome = CLIENT_DISCONNECT
            up.close()  # the client left: drop the worker connection so the worker aborts the generation
        except asyncio.CancelledError:
            up.close()
            raise
        finally:
            if tail:  # a client may hang up once it has the last event: the usage is read all the same
                att.usage = parse_usage(tail)
        return resp


ROUTER_KEY = web.AppKey("router", Router)


def create_router_app(policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None,
                      seed: int = 0, clock: Callable[[], float] | None = None) -> web.Application:
    """The router as an aiohttp app; ``app[ROUTER_KEY]`` is its ``Router`` (workers, stats, policy, core).
    ``clock``: the router core's and the policy's time (default time.monotonic), e.g. a test's fake clock."""
    router = Router(policy, worker_urls, cfg, seed, clock)
    app = make_app(router.cfg.client_max_size)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    for path in ROUTES:
        app.router.add_post(path, partial(router.forward, route=path))
    router.control.add_routes(app)
    return app


async def serve_router(policy, worker_urls: list[str], cfg: RouterServiceConfig | None = None, seed: int = 0) -> None:
    """Serve the router on ``cfg.host:cfg.port`` until the calling task is cancelled. Meant as a process's main
    task: it tunes the process's garbage collector (server_base.tune_gc_for_serving)."""
    app = create_router_app(policy, worker_urls, cfg, seed)
    tune_gc_for_serving()
    await serve_forever(app, app[ROUTER_KEY].cfg.host, app[ROUTER_KEY].cfg.port)
