"""The router's control plane: which workers it routes to (health checks, add, remove with a drain) and the
control endpoints. A base of ``router.Router``, split off to keep files small: it works on the router's state
(``workers``, ``policy``, ``cfg``, ``session``, ``stats``), set up by ``Router.__init__`` and ``Router.start``."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from framework.serving.http.errors import ApiError
from framework.serving.router.health import CircuitBreaker, WorkerState, describe_error, normalize_worker_url
from framework.serving.http.server_base import metrics_response

log = logging.getLogger("framework.serving.router.service")


class RouterControl:
    # ------------------------------------------------------------------ workers

    def _register(self, url: str) -> WorkerState:
        if url in self.workers:
            raise ApiError(409, f"url: worker {url} is already registered", param="url")
        state = WorkerState(url, CircuitBreaker(self.cfg.breaker_failure_threshold, self.cfg.breaker_cooldown_secs))
        self.workers[url] = state
        if url in self.policy.loads:  # a policy handed over with workers: start this one afresh
            self.policy.remove_worker(url)
        self.policy.add_worker(url)
        return state

    def _is_current(self, w: WorkerState) -> bool:
        return self.workers.get(w.url) is w

    async def _check(self, w: WorkerState) -> None:
        unreachable = False
        try:
            async with self.session.get(w.url + "/health", timeout=self._health_timeout) as resp:
                await resp.read()
                ok, error = resp.status == 200, None if resp.status == 200 else f"/health answered {resp.status}"
        except (aiohttp.ClientError, OSError) as exc:
            ok, error = False, describe_error(exc)
            unreachable = isinstance(exc, aiohttp.ClientConnectorError)
        if ok != w.healthy:
            log.info("worker %s is now %s%s", w.url, "healthy" if ok else "unhealthy", f" ({error})" if error else "")
        if ok and w.unreachable and self._is_current(w):
            self.policy.reset_worker(w.url)  # nothing listened there a moment ago: it may have restarted, cold
        if ok and self._is_current(w):
            self.events.worker_up(w.url)  # subscribe to what the policy follows of it (once)
        w.healthy, w.last_health_error = ok, error
        w.unreachable = unreachable or (w.unreachable and not ok)

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def add_worker(self, url: str) -> WorkerState:
        url = normalize_worker_url(url)
        removal = self._removals.get(url)
        if removal is not None:  # being removed: it comes back once that is done, afresh
            await asyncio.shield(removal)
        state = self._register(url)
        await self._check(state)
        return state

    async def remove_worker(self, url: str) -> dict:
        url = normalize_worker_url(url)
        removal = self._removals.get(url)
        if removal is None:
            w = self.workers.get(url)
            if w is None:
                raise ApiError(404, f"url: unknown worker {url}; workers: {sorted(self.workers)}", param="url")
            w.draining = True  # no new requests from here on
            removal = self._removals[url] = asyncio.create_task(self._drain(w))
        return await asyncio.shield(removal)  # a caller that leaves does not stop the drain

    async def _drain(self, w: WorkerState) -> dict:
        try:
            drained_from = w.in_flight
            try:
                await asyncio.wait_for(w.idle.wait(), self.cfg.drain_timeout_secs)
            except TimeoutError:
                log.warning("worker %s still had %d requests after %.0fs of draining", w.url, w.in_flight,
                            self.cfg.drain_timeout_secs)
            del self.workers[w.url]
            self.policy.remove_worker(w.url)
            await self.events.stop(w.url)
            return {"removed": w.url, "drained_requests": drained_from, "abandoned_requests": w.in_flight}
        finally:
            del self._removals[w.url]

    # ------------------------------------------------------------------ control endpoints

    async def handle_add_worker(self, request: web.Request) -> web.Response:
        w = await self.add_worker(request.query.get("url"))
        return web.json_response({"added": w.url, "healthy": w.healthy, "workers": sorted(self.workers)})

    async def handle_remove_worker(self, request: web.Request) -> web.Response:
        return web.json_response(await self.remove_worker(request.query.get("url")))

    async def handle_list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": list(self.workers), "workers": [w.describe() for w in self.workers.values()],
                                  "loads": dict(self.policy.loads)})  # the policy's in-flight counts

    async def handle_health(self, request: web.Request) -> web.Response:
        healthy = sum(w.healthy for w in self.workers.values())
        return web.json_response({"status": "ok", "workers": len(self.workers), "healthy_workers": healthy})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def handle_router_stats(self, request: web.Request) -> web.Response:
        accuracy = getattr(self.policy, "accuracy", None)  # a policy's own account of its estimates, when it keeps one
        return web.json_response({**self.stats.snapshot(self.workers.values()), "kv_events": self.events.stats(),
                                  **({"policy_accuracy": dict(accuracy)} if accuracy else {})})

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
        for url, (status, _) in answers.items():
            if status == 200 and url in self.workers:
                self.policy.reset_worker(url)  # its cache is empty now: so is the estimate of it
        failed = {u: (status, body) for u, (status, body) in answers.items() if status != 200}
        if failed:
            raise ApiError(502, f"flush_cache failed on {len(failed)} of {len(answers)} workers: {failed}")
        return web.json_response({"success": True, "workers": sorted(answers)})

    async def handle_models(self, request: web.Request) -> web.Response:
        answers = await self._fan_out("GET", "/v1/models")
        cards = {c["id"]: c for status, body in answers.values() if status == 200 for c in body.get("data", [])}
        return web.json_response({"object": "list", "data": list(cards.values())})
