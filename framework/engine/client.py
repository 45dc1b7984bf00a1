"""The async face of an engine for the HTTP worker: the engine steps in a background thread; `generate` streams
each request's tokens back to the asyncio loop that asked for them."""
from __future__ import annotations

import asyncio
import codecs
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

from framework.engine.request import Req, SamplingParams
from framework.moe_stats import rank_expert_counts

log = logging.getLogger(__name__)


@dataclass
class GenerateOutput:
    text: str                              # new text since the previous output
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None       # stop | length | abort
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Stream:
    """Per-request delivery state: where outputs go, an incremental UTF-8 decoder, and text held back while it
    could still turn out to be the start of a stop string (a stop string is cut from the returned text)."""

    def __init__(self, req: Req, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue):
        self.req, self.loop, self.sink, self.sent = req, loop, sink, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, item)

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        """On the asyncio side: each output until the finished one; an error pushed by the engine side is raised."""
        while True:
            item = await self.sink.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    def emit(self) -> None:
        req = self.req
        new = req.output_ids[self.sent:]
        self.sent = len(req.output_ids)
        text = self.held + self.decoder.decode(bytes(t for t in new if t < 256), final=req.finished)
        text, self.held = _split_stop(text, req.params.stop, req.finished)
        self.push(GenerateOutput(text, new, req.finished, req.finish_reason, len(req.prompt_ids),
                                 len(req.output_ids), max(req.cached_tokens, 0)))


def _split_stop(text: str, stops: list[str], finished: bool) -> tuple[str, str]:
    """(text to send now, text to hold back). Cut at the first stop string; hold a tail that may begin one."""
    if not stops:
        return text, ""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], ""
    if finished:
        return text, ""
    hold = max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)
    return (text[:-hold], text[-hold:]) if hold else (text, "")


class EngineClient:
    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._info: dict = engine.server_info()
        self._stop = threading.Event()
        self.error: str | None = None          # set when the engine thread died: the worker reports unhealthy
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- asyncio side ------------------------------------------------------------------------------------
    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[GenerateOutput]:
        """Yields incremental outputs; the last has finished=True. Raises ValueError for a request that can
        never be served (bad params, longer than the KV capacity). Cancelling the iteration aborts the request."""
        params.validate()
        if self.error is not None:
            raise RuntimeError(f"engine is down: {self.error}")
        req = Req(self.tokenizer.encode(prompt), params)
        stream = Stream(req, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", stream))
        if self.error is not None or not self._thread.is_alive():   # died while we queued: fail, do not wait
            self._fail_pending(self.error or "engine thread stopped")
        finished = False
        try:
            async for item in stream.outputs():
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(("abort", req.rid))

    def server_info(self) -> dict:
        """The engine's last snapshot, plus routed slots per expert of each MoE layer since start (read live:
        a few small tensors, only when asked)."""
        return {**self._info, "expert_counts": rank_expert_counts(self.engine.model)[0]}

    async def flush_cache(self) -> bool:
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inbox.put(("flush", done))
        return await done

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(("noop", None))
        self._thread.join(timeout=10)

    # -- engine thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.scheduler.has_work())
            self._info = engine.server_info()      # a request just added shows as queued
            try:
                out = engine.step()
            except Exception as e:           # noqa: BLE001 - a dead engine must fail its requests, not hang them
                log.exception("engine step failed")
                self.error = f"{type(e).__name__}: {e}"
                self._fail_pending(self.error)
                return
            self._info = engine.server_info()      # before the outputs: a finished request no longer shows
            for req in out or ():
                stream = self._streams.get(req.rid)
                if stream is not None:
                    stream.emit()
                    if req.finished:
                        del self._streams[req.rid]
        self._fail_pending("the engine client was closed")

    def _fail_pending(self, why: str) -> None:
        """Nothing waits forever: requests still queued or in flight when the loop ends get an error."""
        self.error = self.error or why
        for stream in self._streams.values():
            stream.push(RuntimeError(f"engine is down: {self.error}"))
        self._streams.clear()
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg.push(RuntimeError(f"engine is down: {self.error}"))
            elif kind == "flush":
                arg.get_loop().call_soon_threadsafe(arg.set_result, False)
    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            try:
                self.engine.add(arg.req)
                self._streams[arg.req.rid] = arg
            except ValueError as e:
                arg.push(e)
        elif kind == "abort":
            self._streams.pop(arg, None)
            self.engine.scheduler.abort(arg)
        elif kind == "flush":
            ok = self.engine.scheduler.num_requests() == 0
            if ok:
                self.engine.scheduler.cache.reset()
            arg.get_loop().call_soon_threadsafe(arg.set_result, ok)
