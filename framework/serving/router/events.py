"""What reaches the routing policy besides the requests: the workers' KV events, their load reports, and each
request's usage. The router service owns the I/O; the policy gets plain calls (``on_worker_event``,
``on_request_done(usage=...)``), so the simulator can make the same calls with its own events.

- KV events (a policy subscribed to ``KV_EVENTS``): one ``KvEventSubscriber`` (framework/kv_events/subscriber.py) per
  worker, started once the worker passes a health check. The endpoint is what the worker advertises in
  ``/get_server_info`` (``kv_events.endpoint`` and ``kv_events.replay_endpoint``: servelab's workers), else
  ``tcp://<worker host>:<router.kv_events_port>`` (vLLM's convention: ``--kv-events-config`` publishes on
  ``tcp://*:5557``; its replay socket on ``router.kv_events_replay_port`` when one is set). A router that joins late
  replays from the worker's last cache clear (``kv_events.cleared_seq``; else from 0). A resync (lost batches, a
  restarted worker) drops the policy's view of that worker (``reset_worker``).
- Load reports (``LOAD``): ``GET /get_load`` (SGLang's: one object per DP rank with ``num_reqs``,
  ``num_waiting_reqs``, ``num_tokens``) on every healthy worker every ``router.load_poll_interval_s``.
- Usage (``USAGE``): the prompt, cached and output tokens the worker reported for a request, read from its JSON
  answer or from the last event of its stream (native ``meta_info`` or OpenAI ``usage``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

import aiohttp

from framework.kv_events.subscriber import KvEventSubscriber
from framework.contracts.routing import KV_EVENTS, LOAD, USAGE, LoadReport, RequestUsage

log = logging.getLogger("framework.serving.router.service")
USAGE_TAIL = 8192  # bytes of a stream kept to read its last event's usage


def parse_usage(body: bytes) -> RequestUsage | None:
    """The usage in a JSON answer or in the last SSE event that has one (None when there is none)."""
    text = body.strip()
    candidates = [text] if text.startswith(b"{") else [
        line[5:].strip() for line in reversed(text.split(b"\n")) if line.startswith(b"data:")]
    for raw in candidates:
        if not raw.startswith(b"{"):
            continue  # [DONE], or a cut line
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        meta = doc.get("meta_info")
        if isinstance(meta, dict) and "prompt_tokens" in meta:
            return RequestUsage(meta["prompt_tokens"], meta.get("cached_tokens", 0), meta.get("completion_tokens", 0))
        usage = doc.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            details = usage.get("prompt_tokens_details") or {}
            return RequestUsage(usage["prompt_tokens"], details.get("cached_tokens", 0),
                                usage.get("completion_tokens", 0))
    return None


class WorkerEvents:
    """The subscriptions of one router: started with it, told when a worker is up or gone."""

    def __init__(self, router):
        self.router = router
        subs = router.policy.subscriptions
        self.kv, self.load, self.usage = KV_EVENTS in subs, LOAD in subs, USAGE in subs
        self.subscribers: dict[str, tuple[KvEventSubscriber, asyncio.Task]] = {}
        self.problems: dict[str, str] = {}  # worker -> the last event its policy refused (logged once)
        self._pending: set[str] = set()

    def start(self) -> list[asyncio.Task]:
        if self.load:
            return [asyncio.create_task(self.router._every(self.router.cfg.load_poll_interval_s, self.poll_loads))]
        return []

    async def close(self) -> None:
        for url in list(self.subscribers):
            await self.stop(url)

    # -- KV events ---------------------------------------------------------------------------------------------------
    def worker_up(self, url: str) -> None:
        """A health check passed: subscribe to its KV events if not yet (in a task: it asks the worker first)."""
        if self.kv and url not in self.subscribers and url not in self._pending:
            self._pending.add(url)
            asyncio.create_task(self._subscribe(url))

    async def stop(self, url: str) -> None:
        entry = self.subscribers.pop(url, None)
        if entry is not None:
            entry[1].cancel()
            await asyncio.gather(entry[1], return_exceptions=True)

    async def _subscribe(self, url: str) -> None:
        try:
            endpoint, replay, start = await self._endpoints(url)
            if endpoint is None:
                log.warning("worker %s advertises no KV events and router.kv_events_port is not set: the policy "
                            "sees nothing of its cache", url)
                return
            w = self.router.workers.get(url)
            if w is None:
                return
            sub = KvEventSubscriber(endpoint, replay, lambda batch: self._deliver(w, batch),
                                    lambda why: self._resync(w), name=url, start_seq=start)
            self.subscribers[url] = (sub, asyncio.create_task(sub.run()))
        finally:
            self._pending.discard(url)

    async def _endpoints(self, url: str) -> tuple[str | None, str | None, int]:
        """(event endpoint, replay endpoint, the first batch the view needs) of a worker."""
        cfg = self.router.cfg
        try:
            async with self.router.session.get(url + "/get_server_info", timeout=self.router._control_timeout) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            info = {}
        kv = info.get("kv_events") if isinstance(info, dict) else None
        if isinstance(kv, dict) and kv.get("endpoint"):
            return kv["endpoint"], kv.get("replay_endpoint"), int(kv.get("cleared_seq", 0))
        if cfg.kv_events_port:
            host = urlsplit(url).hostname
            replay = f"tcp://{host}:{cfg.kv_events_replay_port}" if cfg.kv_events_replay_port else None
            return f"tcp://{host}:{cfg.kv_events_port}", replay, 0
        return None, None, 0

    def _deliver(self, w, batch) -> None:
        if not self.router._is_current(w):
            return
        policy = self.router.policy
        for event in batch.events:
            try:
                policy.on_worker_event(w.url, event)
            except ValueError as e:  # the policy cannot use it (e.g. another block size): say so once per worker
                if self.problems.get(w.url) != str(e):
                    log.error("KV events from %s: %s", w.url, e)
                self.problems[w.url] = str(e)
        self.router.release_held(w.url)

    def _resync(self, w) -> None:
        if self.router._is_current(w):
            self.router.policy.reset_worker(w.url)

    def stats(self) -> dict:
        return {url: {"endpoint": sub.endpoint, "last_seq": sub.last_seq, **sub.stats,
                      **({"problem": self.problems[url]} if url in self.problems else {})}
                for url, (sub, _) in self.subscribers.items()}

    # -- load reports ------------------------------------------------------------------------------------------------
    async def poll_loads(self) -> None:
        async def one(w):
            try:
                async with self.router.session.get(w.url + "/get_load", timeout=self.router._health_timeout) as r:
                    body = await r.json(content_type=None) if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return
            ranks = body if isinstance(body, list) else [body] if isinstance(body, dict) else []
            try:
                reqs = sum(int(x.get("num_reqs", 0)) for x in ranks)
                waiting = sum(int(x.get("num_waiting_reqs", 0)) for x in ranks)
                tokens = sum(int(x.get("num_tokens", 0)) for x in ranks)
            except (AttributeError, TypeError, ValueError):
                return
            if ranks and self.router._is_current(w):
                self.router.policy.on_worker_event(w.url, LoadReport(reqs - waiting, waiting, tokens))
        await asyncio.gather(*(one(w) for w in list(self.router.workers.values()) if w.healthy))
