"""The router service: one HTTP front for many workers, choosing each request's worker with a routing policy.
An asyncio shell over the router core (framework/routing/core.py), which decides and counts: this module forwards.

It speaks the workers' client APIs (native ``/generate``, OpenAI completions and chat, every prompt shape SGLang and
vLLM take). It serves on its own HTTP/1.1 server (server.py: asyncio protocols and httptools) and forwards on pooled
kept-alive connections (upstream.py); headers stay bytes and pass through both ways (hop-by-hop ones removed), and
streams go chunk by chunk. Why not aiohttp: experiments/bench_router (the same process on aiohttp cost 2-3x
sglang-router's CPU per request). ``create_router_app`` runs the same handling behind an aiohttp app
(aiohttp_shell.py), for code that embeds the router in one. On its own server, a non-streamed request admitted at
once goes the callback path (flight.py: the same steps as explicit state, no task or await; docs/router-performance.md);
the rest, and every request behind aiohttp, run the coroutine path below. In front of the forwarding, the front door
(docs/router-security.md): request ids, CORS, API keys (security.py), admission control (admission.py).
With prefill and decode workers (their roles from GET /server_info) every request goes to a pair, as sglang-router's
P/D mode sends it (pd.py; the pair and the per-request decider: framework/routing/pairs.py).

Reliability, beyond SGLang router 0.1.0 (docs/fidelity.md, "Router"):

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
from dataclasses import dataclass, field
from functools import partial
from typing import Callable
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError

from framework.contracts.routing import RequestView
from framework.routing.core import BROKEN_STREAM, CLIENT_DISCONNECT, FAIL, OK, Attempt, RouterCore
from framework.routing.dp_aware import DP_RANK_HEADER, DPAware, dp_rank_of
from framework.routing.workers import WorkerState
from framework.serving.http import protocol as P
from framework.serving.http.errors import ApiError, json_bytes, validation_error
from framework.serving.http.proxy import RETRY_SAME_WORKER, ROUTE_HEADER, WORKER_HEADER, retry_after_s, route_header
from framework.serving.http.server_base import tune_gc_for_serving
from framework.serving.router.admission import Admission
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.control import ControlEndpoints, Membership
from framework.serving.router.events import USAGE_TAIL, WorkerEvents, parse_usage
from framework.serving.router.flight import Flight
from framework.serving.router.health import WaitTimer, WorkerTimeout, describe_error, normalize_worker_url, run_every
from framework.serving.router.pd import PairRouting
from framework.serving.router.security import Guard, parse_control_keys
from framework.serving.router.server import (Answering, Connection, Headers, HttpServer, Request, server_ssl_context,
                                             start_server)
from framework.serving.router.stats import router_registry
from framework.serving.router.upstream import UpstreamConnectError, UpstreamPool, UpstreamResponse
from framework.serving.router.wire import Failed, forwarded_head, judged, returned_headers, returned_lines

log = logging.getLogger(__name__)

ROUTES = {"/generate": P.GenerateRouting, "/v1/completions": P.CompletionRouting,
          "/v1/chat/completions": P.ChatRouting}
# each route's body validator, called directly (parse_body's, without its two Python frames on every request)
_VALIDATE = {route: view.__pydantic_validator__.validate_json for route, view in ROUTES.items()}
_WORKER_B, _ROUTE_B = WORKER_HEADER.encode(), ROUTE_HEADER.encode()
_DP_RANK_B = DP_RANK_HEADER.encode()


@dataclass(slots=True)
class _Call:
    """One client request, over all its attempts."""
    route: str
    raw: bytes
    request: str | RequestView  # what the policy routes on: the text, or a view with the client's token ids
    stream: bool
    head: bytes  # the request's header lines for the worker, Content-Length included
    rid: str  # its X-Request-Id: what /abort_request names
    first_byte_by: float  # time.monotonic() deadlines
    done_by: float
    answered: bool = False  # bytes went to the client: no other attempt can be made
    outcome: str = "invalid_request"
    tried: list[WorkerState] = field(default_factory=list)


class _Origin:
    """Where a worker's requests go: its pooled connections' key and the start of every request line."""
    __slots__ = ("key", "host", "url", "lines")

    def __init__(self, url: str):
        u = urlsplit(url)
        self.key = (u.hostname, u.port or (443 if u.scheme == "https" else 80), u.scheme == "https")
        self.host, self.url = u.netloc.encode(), url.encode()
        self.lines = {route: b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (route.encode(), self.host) for route in ROUTES}

    def request(self, call: _Call, dp_rank: int | None = None) -> bytes:
        """The call's whole request to this worker, head and body; router.dp_aware: with the DP group chosen."""
        if dp_rank is None:
            return b"%s%s%s" % (self.lines[call.route], call.head, call.raw)
        return b"%s%s: %d\r\n%s%s" % (self.lines[call.route], _DP_RANK_B, dp_rank, call.head, call.raw)


def _wake(released: list[Attempt]) -> None:
    """Held attempts the core let go: their requests go on (``Router._hold``'s future, or a flight's ``unheld``)."""
    for att in released:
        ref = att.ref
        if isinstance(ref, asyncio.Future):
            if not ref.done():
                ref.set_result(None)
        else:
            ref.unheld()


class Router:
    """``core`` decides and counts (its ``clock``: the policy's, time.monotonic unless given); the client's deadlines
    and the waits on workers run on time.monotonic."""

    def __init__(self, policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None, seed: int = 0,
                 clock: Callable[[], float] | None = None):
        self.policy, self.cfg = policy, cfg or RouterServiceConfig()
        c = self.cfg
        c.validate()
        if c.dp_aware:  # sgl-router's --dp-aware: the policy picks a worker's DP group too (its dp_size: pd.py's ask)
            policy = self.policy = DPAware(policy, lambda url: 1)
        self.core = RouterCore(policy, clock, c.breaker_failure_threshold, c.breaker_cooldown_secs)
        self.workers, self.stats = self.core.workers, self.core.stats
        self.admission = Admission(c.max_concurrent_requests, c.queue_size, c.queue_timeout_secs,
                                   c.rate_limit_tokens_per_second)
        self.guard = Guard(c.api_key, parse_control_keys(c.control_plane_api_keys), c.control_plane_audit_enabled,
                           c.request_id_headers, c.cors_allowed_origins)
        self.registry = router_registry(self.stats, self.workers.values, self.admission.stats)
        # the data path's connections to the workers; the control plane's requests (health checks, aborts, KV-event
        # discovery, load polls, fan-outs) go through an aiohttp session made at start, which the others get from
        # _session
        self.pool = UpstreamPool(c.connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.events = WorkerEvents(self.core, c, self._session, _wake)  # what the policy subscribed to
        self.membership = Membership(self.core, c, self.events, self._session)
        self.control = ControlEndpoints(self.core, self.membership, self.events, self.registry, self._session,
                                        self.guard, self.admission)
        self._removals = self.membership.removals
        self.pd = PairRouting(self)  # prefill/decode workers: requests go to pairs (pd.py)
        self._rng = random.Random(seed)
        self._tasks: list[asyncio.Task] = []
        self._origins: dict[str, _Origin] = {}
        self._flights: dict = {}  # the requests on the callback path now (flight.py), for the deadline sweep
        tick = min(1.0, min(c.request_timeout_s, c.first_byte_timeout_s, c.total_timeout_s) / 10)
        self._timer = WaitTimer(c.request_timeout_s, tick)
        self._first_byte_name = f"router.first_byte_timeout_s={c.first_byte_timeout_s:g}"
        self._total_name = f"router.total_timeout_s={c.total_timeout_s:g}"
        self._abort_timeout = aiohttp.ClientTimeout(total=c.abort_timeout_s)
        self.routes: dict[str, tuple[str, Callable]] = {
            **{path: ("POST", partial(self.forward, route=path)) for path in ROUTES}, **self.control.routes()}
        for url in worker_urls:
            self.membership.register(normalize_worker_url(url))

    # ------------------------------------------------------------------ lifecycle

    async def start(self, app=None) -> None:
        """The router's client side and periodic jobs (``app``: aiohttp's on_startup calls it with one)."""
        # DummyCookieJar: a proxy must not replay one client's cookies (set by a worker) on other clients' requests.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                             timeout=aiohttp.ClientTimeout(total=None,
                                                                           sock_connect=self.cfg.connect_timeout_s),
                                             cookie_jar=aiohttp.DummyCookieJar())
        await self.check_health()  # whoever is up now takes traffic at once; the rest join on a later check
        self._tasks = [asyncio.create_task(run_every(self.cfg.health_check_interval_secs, self.check_health)),
                       asyncio.create_task(run_every(self.cfg.maintain_interval_secs, self._maintain)),
                       asyncio.create_task(run_every(self._timer.tick_s, self._sweep)), *self.events.start()]

    async def close(self, app=None) -> None:
        tasks = self._tasks + list(self._removals.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pd.close()
        await self.events.close()
        self.pool.close()
        if self.session is not None:
            await self.session.close()

    async def listen(self, host: str | None = None, port: int | None = None) -> "RouterServer":
        """Start the router and serve it on host:port (default: the config's; port 0: any free one)."""
        c = self.cfg
        await self.start()
        ssl_context = server_ssl_context(c.tls_cert_path, c.tls_key_path) if c.tls_cert_path else None
        try:
            server = await start_server(self.on_request, c.host if host is None else host,
                                        c.port if port is None else port, c.client_max_size, self.extra_headers,
                                        ssl_context)
        except BaseException:
            await self.close()
            raise
        return RouterServer(self, server)

    def _session(self) -> aiohttp.ClientSession:
        return self.session

    async def check_health(self) -> None:
        await self.membership.check_health()
        await self.pd.discover()  # the role of each worker that came up (GET /server_info)

    async def add_worker(self, url: str) -> WorkerState:
        state = await self.membership.add_worker(url)
        await self.pd.discover()
        return state

    async def remove_worker(self, url: str) -> dict:
        return await self.membership.remove_worker(url)

    async def _maintain(self) -> None:
        self.core.maintain()

    async def _sweep(self) -> None:
        now = time.monotonic()
        self._timer.sweep(now)
        for flight in [f for f in self._flights if f.expiry < now]:  # the callback path's deadlines (flight.py)
            flight.expired()

    # ------------------------------------------------------------------ every request

    def extra_headers(self, req: Request, status: int) -> Headers:
        """On every answer: the request id, and CORS headers for an allowed Origin."""
        if req.rid is None:
            return []
        headers = [(b"X-Request-Id", req.rid)]
        if self.guard.cors_on:
            headers += self.guard.cors_headers(req.lower)
        return headers

    def on_request(self, req: Request, conn: Connection) -> None:
        """Every request on the router's own server (server.py). Non-streamed generation requests that are admitted
        at once, when no worker pair is in play, go the callback path (flight.py: no task, no await); the rest run
        ``handle`` in a task (streams, the admission queue, P/D pairs, the control plane)."""
        route = req.path
        if req.method != "POST" or route not in ROUTES or self.pd.active:
            conn.run(self.handle(req, conn))
            return
        req.rid = self.guard.request_id(req.lower)
        try:
            call = self.prepare(req, route)
        except ApiError as err:
            conn.send_error(err)
            return
        admission = self.admission
        if call.stream or (admission.enabled and not admission.try_admit()):
            conn.run(self._run_answering(req, conn, call))
            return
        Flight(self, conn, call, admission.enabled).start()

    async def _run_answering(self, req: Request, conn: Answering, call: _Call) -> None:
        try:
            await self.run_call(req, conn, call, admitted=False)
        except ApiError as err:  # not admitted, no worker
            conn.send_error(err)

    async def handle(self, req: Request, conn: Answering) -> None:
        req.rid = self.guard.request_id(req.lower)
        try:
            if req.method == "OPTIONS" and (allow := self.guard.preflight(req.lower)) is not None:
                conn.send(200, allow)  # the origin's headers come with extra_headers
                return
            if req.method == "POST" and req.path in ROUTES:  # the data path: no route lookup, no partial
                await self.forward(req, conn, req.path)
                return
            route = self.routes.get(req.path)
            if route is None:
                raise ApiError(404, f"no route {req.method} {req.path}")
            if req.method != route[0]:
                raise ApiError(405, f"method {req.method} not allowed on {req.path}; allowed: {route[0]}",
                               headers={"Allow": route[0]})
            await route[1](req, conn)
        except ApiError as err:
            conn.send_error(err)

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

    def prepare(self, req: Request, route: str) -> _Call:
        """The key check and the body's validation (ApiError 401 / 400: an invalid one is counted here)."""
        if self.guard.api_key is not None:
            self.guard.data_plane(req.lower)
        try:
            try:
                view = _VALIDATE[route](req.body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            prompt = view.__dict__  # token_ids() looks its fields up with getattr: ~5% of the CPU when one is absent
            ids = view.token_ids() if isinstance(prompt.get("input_ids") or prompt.get("prompt"), list) else None
            text = view.routing_text()
        except BaseException:
            self.stats.outcomes[route, "invalid_request"] += 1
            raise
        now = time.monotonic()
        return _Call(route, req.body, text if ids is None else RequestView(text, ids), bool(view.stream),
                     forwarded_head(req, len(req.body)), req.rid.decode("latin-1"),
                     now + self.cfg.first_byte_timeout_s, now + self.cfg.total_timeout_s)

    async def forward(self, req: Request, conn: Answering, route: str) -> None:
        await self.run_call(req, conn, self.prepare(req, route), admitted=False)

    async def run_call(self, req: Request, conn: Answering, call: _Call, admitted: bool) -> None:
        """A request on the coroutine path, over all its attempts: admission (unless ``admitted``), then the
        attempts; its outcome counted."""
        try:
            if not self.admission.enabled:  # (no coroutine for the common case)
                await self._forward(req, conn, call)
                return
            if not admitted:
                call.outcome = "not_admitted"
                await self.admission.admit()
            try:
                await self._forward(req, conn, call)
            finally:
                self.admission.release()
        finally:
            self.stats.outcomes[call.route, call.outcome] += 1

    async def _forward(self, req: Request, conn: Answering, call: _Call) -> None:
        if self.pd.active:  # prefill and decode workers: each request to a pair
            await self.pd.forward(req, conn, call)
            return
        call.outcome = "no_worker"
        failed = None
        while (plan := self._next(call, failed)) is not None:
            call.outcome = CLIENT_DISCONNECT  # until an answer is ready
            pool, delay = plan
            if failed is not None:
                if time.monotonic() + delay >= self._deadline(call)[0]:
                    break  # the client's deadline comes first: answer with the last failure
                await asyncio.sleep(delay)
                now = self.core.clock()
                pool = [w for w in pool if self.core.is_current(w) and w.routable(max(now, w.not_before))]
                if not pool:
                    break
            # every worker routable (the usual case): the policy's own candidates are the same list, in the same
            # order (it is never told a worker is unhealthy), without its check of the names given
            every = len(pool) == len(self.workers)
            att = self.core.dispatch(call.request, None if every else pool, retry=bool(call.tried))
            call.tried.append(att.worker)
            left = self.core.hold(att, self._deadline(call)[0] - time.monotonic())
            if left > 0:
                try:
                    await self._hold(att, left)
                except BaseException:  # the client went away while it was held: it was never sent
                    self.core.release(att)
                    raise
            result = await self._attempt(conn, call, att)
            if not isinstance(result, Failed):
                call.outcome = att.outcome or ("ok" if result < 400 else "client_error")
                return
            failed = result
        call.outcome = "timeout" if failed.timeout else "upstream_error"
        failed.send(conn, len(call.tried))

    async def _hold(self, att: Attempt, left: float) -> None:
        """Wait while the core holds the request (``core.hold``: its prefix is still being prefilled on the worker),
        at most ``left`` s (its hold, or the client's deadline), unless a batch of that worker's events lets it go
        first (``_wake``)."""
        att.ref = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(att.ref, left)
        except TimeoutError:
            self.core.hold_over(att)

    def _origin(self, w: WorkerState) -> _Origin:
        o = self._origins.get(w.url)
        if o is None:
            o = self._origins[w.url] = _Origin(w.url)
        return o

    def _answer_headers(self, up: UpstreamResponse, att: Attempt, origin: _Origin) -> Headers:
        """The worker's end-to-end headers, with which worker answered and the decision that sent the request there."""
        headers = returned_headers(up)
        headers.append((_WORKER_B, origin.url))
        headers.append((_ROUTE_B, route_header(att.decision).encode()))
        return headers

    async def _attempt(self, conn: Answering, call: _Call, att: Attempt) -> int | Failed:
        """One try on one worker. Returns the status answered to the client, or ``Failed``."""
        origin = self._origin(att.worker)
        up = None
        try:
            with self._timer(*self._deadline(call)):  # the response head, then the whole body unless it streams
                up = await self.pool.request(origin.key, origin.request(call, dp_rank_of(att.decision)))
                refused, relay = judged(up)
                body = b"" if relay else await up.read()  # buffered: a failure mid-body is still retriable
            if refused:
                return self._refused(att, up, body)
            if relay:
                return await self._relay(conn, call, up, att, origin)
            return self._answered(conn, att, up, origin, body)
        except OSError as exc:  # (WorkerTimeout among them)
            return await self._attempt_failed(call, att, exc)
        finally:
            if up is not None:
                up.release()  # the connection goes back to the pool when the body was read to the end
            self.core.release(att)

    async def relay_attempt(self, conn: Answering, call: _Call, att: Attempt, up: UpstreamResponse,
                            origin: _Origin) -> int | Failed:
        """The rest of an attempt whose answer streams, from its response head in (the callback path's, flight.py)."""
        try:
            return await self._relay(conn, call, up, att, origin)
        except OSError as exc:
            return await self._attempt_failed(call, att, exc)
        finally:
            up.release()
            self.core.release(att)

    def _refused(self, att: Attempt, up: UpstreamResponse, body: bytes) -> Failed:
        """A worker's answer worth another attempt (408, 429, 5xx)."""
        w, status = att.worker, up.status
        att.verdict = FAIL if status >= 500 and status not in (503, 504) else None  # else busy, not broken
        wait = retry_after_s(up.lower.get(b"retry-after", b"").decode("latin-1")) \
            if status in RETRY_SAME_WORKER else None
        if wait:
            w.not_before = max(w.not_before, self.core.clock() + wait)
        return Failed(w, f"{w.url} answered {status}", status, body, returned_headers(up), retry_after=wait)

    def _answered(self, conn: Answering, att: Attempt, up: UpstreamResponse, origin: _Origin, body: bytes) -> int:
        """A whole answer passed to the client; its status."""
        status = up.status
        att.verdict, att.served = OK, status < 400  # a 4xx is the client's fault: it counts for the worker
        if att.served and self.core.wants_usage:
            att.usage = parse_usage(body)
        if isinstance(conn, Connection):  # the router's own server: the worker's header lines as they were cached
            conn.send_lines(status, b"%s%s: %s\r\n%s: %s\r\n" % (returned_lines(up), _WORKER_B, origin.url, _ROUTE_B,
                                                                  route_header(att.decision).encode()), body)
        else:
            conn.send(status, self._answer_headers(up, att, origin), body)
        return status

    def broke(self, att: Attempt, exc: OSError) -> Failed:
        """An attempt whose connection failed, or that ran past the client's deadline (WorkerTimeout, not silence)."""
        w = att.worker
        if isinstance(exc, WorkerTimeout):  # busy or hung: not a breaker failure
            return Failed(w, f"{w.url}: {exc}", timeout=True, retriable=False)
        timeout = isinstance(exc, TimeoutError)  # a connection that did not open in connect_timeout_s
        att.verdict = None if timeout else FAIL
        if isinstance(exc, UpstreamConnectError) and not timeout:
            w.healthy, w.unreachable = False, True  # skip it until a health check passes again
        return Failed(w, f"{w.url}: {describe_error(exc)}", timeout=timeout)

    async def _attempt_failed(self, call: _Call, att: Attempt, exc: OSError) -> Failed:
        w = att.worker
        if isinstance(exc, WorkerTimeout) and exc.silence:
            confirmed = await self._abort(w, call.rid)
            return Failed(w, f"{w.url}: {exc}; " + ("it confirmed it dropped the request" if confirmed else
                                                     "it did not confirm it dropped the request, which therefore "
                                                     "was not sent to another worker"),
                          timeout=True, retriable=confirmed)
        return self.broke(att, exc)

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

    async def _relay(self, conn: Answering, call: _Call, up: UpstreamResponse, att: Attempt,
                     origin: _Origin) -> int:
        """Pass a stream through as it arrives. Nothing is sent before the worker's first chunk, so a worker that
        fails before it is still retried; after it, a broken stream ends with an SSE error event. Only the waits on
        the worker count towards its silence: a slow client holding up ``conn.write`` does not."""
        w = att.worker
        with self._timer(*self._deadline(call)):
            chunk = await up.readany()
        att.served = up.status < 400
        if att.served and w.role != "decode":   # the first token came (a P/D decode half's came from its prefill)
            self.core.first_token(att)
        tail = b"" if self.core.wants_usage else None  # the stream's end, for the usage in its last event
        try:
            conn.start(up.status, self._answer_headers(up, att, origin))
            call.answered = True
            while chunk:
                if tail is not None:
                    tail = (tail + chunk)[-USAGE_TAIL:]
                await conn.write(chunk)
                try:
                    with self._timer(*self._deadline(call)):
                        chunk = await up.readany()
                except OSError as exc:
                    att.verdict = None if isinstance(exc, TimeoutError) else FAIL
                    att.outcome = BROKEN_STREAM
                    msg = f"worker {w.url} broke the stream: {describe_error(exc)}"
                    await conn.write(P.sse(data=json_bytes(ApiError(502, msg).to_dict())))
                    await conn.end()
                    return up.status
            att.verdict = OK
            await conn.end()
        except ConnectionResetError:
            att.outcome = CLIENT_DISCONNECT
            up.close()  # the client left: drop the worker connection so the worker aborts the generation
        except asyncio.CancelledError:
            up.close()
            raise
        finally:
            if tail:  # a client may hang up once it has the last event: the usage is read all the same
                att.usage = parse_usage(tail)
        return up.status


class RouterServer:
    """A router serving on its own port: ``router``, ``port``; ``await cleanup()`` stops it (as aiohttp's runner)."""

    def __init__(self, router: Router, server: HttpServer):
        self.router, self.server = router, server
        self.port = server.sockets[0].getsockname()[1]
        self.url = f"{'https' if router.cfg.tls_cert_path else 'http'}://{router.cfg.host}:{self.port}"

    async def cleanup(self) -> None:
        self.server.close()
        await self.router.close()
        await self.server.wait_closed()


async def start_router(policy, worker_urls: list[str], cfg: RouterServiceConfig | None = None, seed: int = 0,
                       clock: Callable[[], float] | None = None, port: int | None = None) -> RouterServer:
    """A router over ``worker_urls`` serving on ``cfg.host:cfg.port`` (or ``port``); ``clock`` as Router's."""
    return await Router(policy, worker_urls, cfg, seed, clock).listen(port=port)


def create_router_app(policy, worker_urls: list[str] = (), cfg: RouterServiceConfig | None = None,
                      seed: int = 0, clock: Callable[[], float] | None = None):
    """The same router as an aiohttp app (aiohttp_shell.py; ``app[ROUTER_KEY]`` is its ``Router``), for code that
    serves it on aiohttp's server. ``clock``: the router core's and the policy's time (default time.monotonic)."""
    from framework.serving.router.aiohttp_shell import router_app
    return router_app(Router(policy, worker_urls, cfg, seed, clock))


def __getattr__(name: str):
    if name == "ROUTER_KEY":  # aiohttp_shell's app key, where it has always been imported from
        from framework.serving.router.aiohttp_shell import ROUTER_KEY
        return ROUTER_KEY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def serve_router(policy, worker_urls: list[str], cfg: RouterServiceConfig | None = None, seed: int = 0) -> None:
    """Serve the router on ``cfg.host:cfg.port`` until the calling task is cancelled. Meant as a process's main
    task: it tunes the process's garbage collector (server_base.tune_gc_for_serving)."""
    server = await start_router(policy, worker_urls, cfg, seed)
    tune_gc_for_serving()
    try:
        await asyncio.Event().wait()
    finally:
        await server.cleanup()
