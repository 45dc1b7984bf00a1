"""The HTTP router's control plane: which workers it routes to (health checks, add, remove with a drain) and the
control endpoints. The state is the router core's (framework/routing/core.py: workers, policy, stats); this module
holds the I/O around it. ``Membership`` and ``ControlEndpoints`` are given what they use, the router's client session
(made when it starts) as a getter. A worker added at run time takes no traffic before its first health check passes
(``WorkerState.healthy`` starts False). The control plane is not on the hot path: it keeps aiohttp's client."""
from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Callable

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from framework.contracts.routing import FLUSHED, RESTARTED
from framework.routing.core import RouterCore
from framework.routing.workers import WorkerState
from framework.serving.http.errors import ApiError
from framework.serving.router.admission import Admission
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.events import WorkerEvents
from framework.serving.router.health import describe_error, normalize_worker_url
from framework.serving.router.security import Guard
from framework.serving.router.server import Answering, Request

log = logging.getLogger("framework.serving.router.service")


class Membership:
    """Which workers the core routes to: registered, checked every ``health_check_interval_secs``, drained out."""

    def __init__(self, core: RouterCore, cfg: RouterServiceConfig, events: WorkerEvents,
                 session: Callable[[], aiohttp.ClientSession]):
        self.core, self.cfg, self.events, self.session = core, cfg, events, session
        self.removals: dict[str, asyncio.Task] = {}  # url -> its drain, shared by every remove_worker caller
        self._idle: dict[str, asyncio.Event] = {}  # url -> set when its drain has nothing left in flight
        self._health_timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout_secs)
        core.on_idle = self._now_idle

    def register(self, url: str) -> WorkerState:
        if url in self.core.workers:
            raise ApiError(409, f"url: worker {url} is already registered", param="url")
        return self.core.add_worker(url)

    async def check(self, w: WorkerState) -> None:
        unreachable = False
        try:
            async with self.session().get(w.url + "/health", timeout=self._health_timeout) as resp:
                await resp.read()
                ok, error = resp.status == 200, None if resp.status == 200 else f"/health answered {resp.status}"
        except (aiohttp.ClientError, OSError) as exc:
            ok, error = False, describe_error(exc)
            unreachable = isinstance(exc, aiohttp.ClientConnectorError)
        if ok != w.healthy:
            log.info("worker %s is now %s%s", w.url, "healthy" if ok else "unhealthy", f" ({error})" if error else "")
        current = self.core.is_current(w)
        if ok and w.unreachable and current:
            # nothing listened there a moment ago: it may have restarted, cold; what was held for it goes now
            if released := self.core.reset_worker(w.url, RESTARTED):
                self.events.on_release(released)
        if ok and current:
            self.events.worker_up(w.url)  # subscribe to what the policy follows of it (once)
        w.healthy, w.last_health_error = ok, error
        w.unreachable = unreachable or (w.unreachable and not ok)

    async def check_health(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.core.workers.values())))

    async def add_worker(self, url: str) -> WorkerState:
        url = normalize_worker_url(url)
        removal = self.removals.get(url)
        if removal is not None:  # being removed: it comes back once that is done, afresh
            await asyncio.shield(removal)
        state = self.register(url)
        await self.check(state)
        return state

    async def remove_worker(self, url: str) -> dict:
        url = normalize_worker_url(url)
        removal = self.removals.get(url)
        if removal is None:
            w = self.core.workers.get(url)
            if w is None:
                raise ApiError(404, f"url: unknown worker {url}; workers: {sorted(self.core.workers)}", param="url")
            w.draining = True  # no new requests from here on
            removal = self.removals[url] = asyncio.create_task(self._drain(w))
        return await asyncio.shield(removal)  # a caller that leaves does not stop the drain

    async def _drain(self, w: WorkerState) -> dict:
        try:
            drained_from = w.in_flight
            if drained_from:
                idle = self._idle[w.url] = asyncio.Event()
                try:
                    await asyncio.wait_for(idle.wait(), self.cfg.drain_timeout_secs)
                except TimeoutError:
                    log.warning("worker %s still had %d requests after %.0fs of draining", w.url, w.in_flight,
                                self.cfg.drain_timeout_secs)
            abandoned = w.in_flight
            self.core.remove_worker(w.url)
            await self.events.stop(w.url)
            return {"removed": w.url, "drained_requests": drained_from, "abandoned_requests": abandoned}
        finally:
            self._idle.pop(w.url, None)
            del self.removals[w.url]

    def _now_idle(self, w: WorkerState) -> None:
        idle = self._idle.get(w.url)
        if idle is not None:
            idle.set()


class ControlEndpoints:
    """The router's endpoints besides the generation routes, behind the control-plane keys (security.py): the
    worker admin ones want an admin key and leave an audit line, the read-only ones any control key."""

    def __init__(self, core: RouterCore, membership: Membership, events: WorkerEvents, registry: CollectorRegistry,
                 session: Callable[[], aiohttp.ClientSession], guard: Guard, admission: Admission):
        self.core, self.membership, self.events, self.registry = core, membership, events, registry
        self.session, self.guard, self.admission = session, guard, admission
        self._timeout = aiohttp.ClientTimeout(total=membership.cfg.health_check_timeout_secs * 5)

    def routes(self) -> dict[str, tuple[str, Callable]]:
        """path -> (method, handler(request, answer))."""
        def guarded(level: str):
            return lambda handler: partial(self._guarded, handler=handler, level=level)
        admin, read, data, open_ = (guarded(k) for k in ("admin", "read", "data", "open"))
        return {"/add_worker": ("POST", admin(self.add_worker)), "/remove_worker": ("POST", admin(self.remove_worker)),
                "/flush_cache": ("POST", admin(self.flush_cache)),
                "/router_stats/reset": ("POST", admin(self.reset_router_stats)),
                "/list_workers": ("GET", read(self.list_workers)), "/router_stats": ("GET", read(self.router_stats)),
                "/get_server_info": ("GET", data(self.server_info)), "/v1/models": ("GET", data(self.models)),
                "/health": ("GET", open_(self.health)), "/metrics": ("GET", open_(self.metrics))}

    async def _guarded(self, req: Request, conn: Answering, *, handler, level: str) -> None:
        if level == "data":
            self.guard.data_plane(req.lower)
        elif level != "open":
            self.guard.control_plane(req.lower, req.method, req.path, req.query.get("url"), req.rid,
                                     admin=level == "admin")
        await handler(req, conn)

    async def add_worker(self, req: Request, conn: Answering) -> None:
        w = await self.membership.add_worker(req.query.get("url"))
        conn.send_json(200, {"added": w.url, "healthy": w.healthy, "workers": sorted(self.core.workers)})

    async def remove_worker(self, req: Request, conn: Answering) -> None:
        conn.send_json(200, await self.membership.remove_worker(req.query.get("url")))

    async def list_workers(self, req: Request, conn: Answering) -> None:
        now, workers = self.core.clock(), self.core.workers
        conn.send_json(200, {"urls": list(workers), "workers": [w.describe(now) for w in workers.values()],
                             "loads": {u: n for p in self.core.policies() for u, n in p.loads.items()}})  # in flight

    async def health(self, req: Request, conn: Answering) -> None:
        healthy = sum(w.healthy for w in self.core.workers.values())
        conn.send_json(200, {"status": "ok", "workers": len(self.core.workers), "healthy_workers": healthy})

    async def metrics(self, req: Request, conn: Answering) -> None:
        conn.send(200, [(b"Content-Type", CONTENT_TYPE_LATEST.encode())], generate_latest(self.registry))

    async def router_stats(self, req: Request, conn: Answering) -> None:
        conn.send_json(200, {**self.core.snapshot(), "kv_events": self.events.stats(),
                             "admission": self.admission.stats()})

    async def reset_router_stats(self, req: Request, conn: Answering) -> None:
        self.core.stats.reset()
        conn.send_json(200, {"reset": True})

    async def _fan_out(self, method: str, path: str) -> dict[str, tuple[int | None, object]]:
        """``method path`` on every healthy worker at once -> {url: (status or None, JSON body or error text)}."""
        session = self.session()

        async def one(url: str):
            try:
                async with session.request(method, url + path, timeout=self._timeout) as resp:
                    return url, (resp.status, await resp.json(content_type=None))
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return url, (None, describe_error(exc))
        urls = [u for u, w in self.core.workers.items() if w.healthy and not w.draining]
        return dict(await asyncio.gather(*(one(u) for u in urls)))

    async def server_info(self, req: Request, conn: Answering) -> None:
        answers = await self._fan_out("GET", "/get_server_info")
        per_worker = {u: body if status == 200 else {"error": body} for u, (status, body) in answers.items()}
        totals: dict[str, float] = {}
        for info in per_worker.values():
            for k, v in info.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        conn.send_json(200, {"router": {"workers": len(self.core.workers), "healthy_workers": len(answers)},
                             "totals": totals, "workers": per_worker})

    async def flush_cache(self, req: Request, conn: Answering) -> None:
        answers = await self._fan_out("POST", "/flush_cache")
        for url, (status, _) in answers.items():
            if status == 200 and url in self.core.workers:
                # its cache is empty now: so is the estimate of it; what was held for it goes now
                if released := self.core.reset_worker(url, FLUSHED):
                    self.events.on_release(released)
        failed = {u: (status, body) for u, (status, body) in answers.items() if status != 200}
        if failed:
            raise ApiError(502, f"flush_cache failed on {len(failed)} of {len(answers)} workers: {failed}")
        conn.send_json(200, {"success": True, "workers": sorted(answers)})

    async def models(self, req: Request, conn: Answering) -> None:
        answers = await self._fan_out("GET", "/v1/models")
        cards = {c["id"]: c for status, body in answers.values() if status == 200 for c in body.get("data", [])}
        conn.send_json(200, {"object": "list", "data": list(cards.values())})
