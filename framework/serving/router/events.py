"""What reaches the routing policy besides the requests: the workers' KV events, their load reports, and each
request's usage. This module owns the I/O; what arrives goes to the router core (framework/routing/core.py:
``worker_events``, ``load_report``, ``reset_worker``; the usage through ``release``), which the simulator drives with
its own events alike.

- KV events (a policy subscribed to ``KV_EVENTS``): one ``KvEventSubscriber`` (framework/kv_events/subscriber.py) per
  stream of a worker, started once the worker passes a health check. The endpoint is what the worker advertises in
  ``/get_server_info`` (``kv_events.endpoint`` and ``kv_events.replay_endpoint``: servelab's workers), else
  ``tcp://<worker host>:<router.kv_events_port>`` (vLLM's convention: ``--kv-events-config`` publishes on
  ``tcp://*:5557``; its replay socket on ``router.kv_events_replay_port`` when one is set). A router that joins late
  replays from the worker's last cache clear (``kv_events.cleared_seq``; else from 0). A resync (lost batches, a
  restarted worker) drops the policy's view of that worker (``reset_worker`` with the subscriber's cause:
  ``RESTARTED`` when the sequence went back, ``EVENTS_LOST`` otherwise). A servelab worker of several DP groups
  publishes every group's events on its one stream, each batch stamped with the group's ``data_parallel_rank``.
  A vLLM or SGLang worker of several DP ranks publishes each rank on its own stream instead, the port (and the replay
  port) offset by the rank (framework/kv_events/ranks.py): its ranks are ``/get_server_info``'s ``dp_size`` when it
  says it (SGLang: under DP attention only), else ``router.kv_events_dp_size`` (vLLM says nothing there), else 1;
  rank r's batches are rank r's whatever they name, and a gap or a restart on one rank's stream replays or resets
  that rank alone. Either way, under ``router.dp_aware`` each batch goes whole to the candidate ``url@rank`` it names
  (the worker's ``dp_size`` is read from the same ``/get_server_info`` before the first batch, so a replay finds
  every group's candidate); otherwise the groups' events go to the worker as one view that holds a block while any
  group does (framework/kv_events/union.py; one rank's reset drops the blocks only it held).
- Load reports (``LOAD``): ``GET /get_load`` (SGLang's: one object per DP rank with ``num_reqs``,
  ``num_waiting_reqs``, ``num_tokens``) on every healthy worker every ``router.load_poll_interval_s``.
- Usage (``USAGE``): the prompt, cached and output tokens the worker reported for a request, read from its JSON
  answer or from the last event of its stream (native ``meta_info`` or OpenAI ``usage``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable
from urllib.parse import urlsplit

import aiohttp

from framework.contracts.routing import KV_EVENTS, LOAD, RESTARTED, LoadReport, RequestUsage
from framework.core.errors import UserError
from framework.kv_events.events import AllBlocksCleared, KVEventBatch
from framework.kv_events.ranks import RankStream, rank_streams, stamped
from framework.kv_events.subscriber import KvEventSubscriber
from framework.kv_events.union import GroupUnion
from framework.routing.core import Attempt, RouterCore
from framework.routing.dp_aware import DPAware, RankReset, dp_target
from framework.routing.workers import WorkerState
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.health import describe_error, run_every

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


class _NoAnswer(Exception):
    """The worker did not answer ``/get_server_info`` (unreachable, timed out): nothing is settled about its streams."""


class WorkerEvents:
    """The subscriptions of one router: started with it, told when a worker is up or gone. ``on_release`` gets the
    held attempts a batch of KV events lets go (the router sends them)."""

    def __init__(self, core: RouterCore, cfg: RouterServiceConfig, session: Callable[[], aiohttp.ClientSession],
                 on_release: Callable[[list[Attempt]], None]):
        self.core, self.cfg, self.session, self.on_release = core, cfg, session, on_release
        subs = core.policy.subscriptions
        self.kv, self.load = KV_EVENTS in subs, LOAD in subs  # (USAGE: the core's wants_usage, read by the service)
        # worker -> its streams: name (the worker's URL; url@rank for a worker that publishes per rank) -> the
        # stream's subscriber and task
        self.streams: dict[str, dict[str, tuple[KvEventSubscriber, asyncio.Task]]] = {}
        self.unions: dict[str, GroupUnion] = {}   # worker -> its DP groups' blocks (router.dp_aware off)
        self.problems: dict[str, str] = {}  # worker -> the last event its policy refused (logged once)
        self._pending: dict[str, asyncio.Task] = {}   # url -> its subscription, while it asks the worker
        self._info_timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout_secs * 5)
        self._poll_timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout_secs)

    def start(self) -> list[asyncio.Task]:
        if self.load:
            return [asyncio.create_task(run_every(self.cfg.load_poll_interval_s, self.poll_loads))]
        return []

    async def close(self) -> None:
        pending = list(self._pending.values())     # still asking a worker: it would start subscribers after this
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for url in list(self.streams):
            await self.stop(url)

    # -- KV events ---------------------------------------------------------------------------------------------------
    def worker_up(self, url: str) -> None:
        """A health check passed: subscribe to its KV events if not yet (in a task: it asks the worker first)."""
        if self.kv and url not in self.streams and url not in self._pending:
            self._pending[url] = asyncio.create_task(self._subscribe(url))

    @property
    def subscribers(self) -> dict[str, tuple[KvEventSubscriber, asyncio.Task]]:
        """Every stream's subscriber and task, by stream name."""
        return {name: entry for streams in self.streams.values() for name, entry in streams.items()}

    async def stop(self, url: str) -> None:
        entries = list(self.streams.pop(url, {}).values())
        self.unions.pop(url, None)
        for _, task in entries:
            task.cancel()
        await asyncio.gather(*(task for _, task in entries), return_exceptions=True)

    async def _subscribe(self, url: str) -> None:
        try:
            try:
                streams, start, dp_size = await self._streams(url)
            except UserError as e:       # e.g. a rank's port past 65535
                log.error("worker %s: %s; the policy sees nothing of its cache", url, e)
                return
            except _NoAnswer as e:       # asked again at its next passed health check (worker_up)
                log.info("worker %s: no answer to /get_server_info (%s); its KV events are looked up again at its "
                         "next health check", url, e)
                return
            if not streams:
                log.warning("worker %s advertises no KV events and router.kv_events_port is not set: the policy "
                            "sees nothing of its cache", url)
                return
            w = self.core.workers.get(url)
            if w is None:
                return
            if dp_size and isinstance(policy := self.core.policy_of(url), DPAware) and self.core.is_current(w):
                policy.set_dp_size(url, dp_size)     # its candidates before its groups' events (pd.py asks again)
            subs = self.streams[url] = {}
            for s in streams:
                name = url if s.rank is None else dp_target(url, s.rank)
                sub = KvEventSubscriber(s.endpoint, s.replay_endpoint, self._on_batch(w, s.rank),
                                        self._on_resync(w, s.rank), name=name, start_seq=start)
                subs[name] = (sub, asyncio.create_task(sub.run()))
        finally:
            self._pending.pop(url, None)

    def _on_batch(self, w: WorkerState, rank: int | None) -> Callable[[KVEventBatch], None]:
        return lambda batch: self._deliver(w, stamped(batch, rank))

    def _on_resync(self, w: WorkerState, rank: int | None) -> Callable[[str, str], None]:
        def resync(why: str, cause: str = RESTARTED) -> None:
            self._resync(w, cause, rank)
        return resync

    async def _streams(self, url: str) -> tuple[list[RankStream], int, int | None]:
        """(the worker's event streams, the first batch a view needs, its DP groups if it says)."""
        cfg = self.cfg
        try:
            async with self.session().get(url + "/get_server_info", timeout=self._info_timeout) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError) as e:   # no answer (not "no such endpoint", as vLLM's 404)
            raise _NoAnswer(describe_error(e)) from None
        except ValueError:
            info = {}
        info = info if isinstance(info, dict) else {}
        kv = info.get("kv_events")
        dp_size = info.get("dp_size") if isinstance(info.get("dp_size"), int) and info["dp_size"] >= 1 else None
        if isinstance(kv, dict) and kv.get("endpoint"):   # servelab's: every group on one stream
            return [RankStream(None, kv["endpoint"], kv.get("replay_endpoint"))], int(kv.get("cleared_seq", 0)), \
                dp_size
        if not cfg.kv_events_port:
            return [], 0, dp_size
        # SGLang publishes per attn_dp_rank, which is 0 on every scheduler without DP attention
        ranks = dp_size if dp_size and info.get("enable_dp_attention", True) is not False else None
        ranks = ranks or cfg.kv_events_dp_size or 1
        host = urlsplit(url).hostname
        replay = f"tcp://{host}:{cfg.kv_events_replay_port}" if cfg.kv_events_replay_port else None
        return rank_streams(f"tcp://{host}:{cfg.kv_events_port}", replay, ranks), 0, dp_size or \
            (ranks if ranks > 1 else None)

    def _deliver(self, w: WorkerState, batch) -> None:
        if self.core.is_current(w):
            # router.dp_aware: the whole batch, whose data_parallel_rank names the worker's DP group
            if isinstance(self.core.policy_of(w.url), DPAware):
                events = [batch]
            elif batch.data_parallel_rank is None:
                events = batch.events
            else:                 # one DP group's, of a worker the policy sees whole
                events = self.unions.setdefault(w.url, GroupUnion()).events(batch)
            released = self.core.worker_events(w.url, events, self._refused)
            if released:
                self.on_release(released)

    def _refused(self, url: str, e: ValueError) -> None:
        """The policy cannot use an event (e.g. another block size): say so once per worker."""
        if self.problems.get(url) != str(e):
            log.error("KV events from %s: %s", url, e)
        self.problems[url] = str(e)

    def _resync(self, w: WorkerState, cause: str, rank: int | None = None) -> None:
        """The view of ``w`` is void (``cause``: the subscriber's: RESTARTED or EVENTS_LOST), or of its DP rank
        ``rank`` only (a worker that publishes per rank); the requests held for it that the policy lets go now are
        sent."""
        if not self.core.is_current(w):
            return
        if rank is None:
            if w.url in self.unions:
                self.unions[w.url].reset()
            released = self.core.reset_worker(w.url, cause)
        elif isinstance(self.core.policy_of(w.url), DPAware):
            released = self.core.worker_events(w.url, [RankReset(rank, cause)], self._refused)
        else:   # the worker seen whole: the blocks only that rank held leave its view
            cleared = KVEventBatch(0.0, (AllBlocksCleared(),), rank)
            released = self.core.worker_events(
                w.url, self.unions.setdefault(w.url, GroupUnion()).events(cleared), self._refused)
        if released:
            self.on_release(released)

    def stats(self) -> dict:
        out = {}
        for url, streams in self.streams.items():
            for name, (sub, _) in streams.items():
                out[name] = {"endpoint": sub.endpoint, "last_seq": sub.last_seq, **sub.stats,
                             **({"problem": self.problems[url]} if url in self.problems else {})}
        return out

    # -- load reports ------------------------------------------------------------------------------------------------
    async def poll_loads(self) -> None:
        async def one(w: WorkerState):
            try:
                async with self.session().get(w.url + "/get_load", timeout=self._poll_timeout) as r:
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
            if ranks and self.core.is_current(w):
                self.core.load_report(w.url, LoadReport(reqs - waiting, waiting, tokens))
        await asyncio.gather(*(one(w) for w in list(self.core.workers.values()) if w.healthy))
