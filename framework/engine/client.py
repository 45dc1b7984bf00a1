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


class _Stream:
    """Per-request state on the engine thread: where to deliver, and an incremental UTF-8 decoder."""

    def __init__(self, req: Req, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue):
        self.req, self.loop, self.sink, self.sent = req, loop, sink, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, item)

    def emit(self) -> None:
        req = self.req
        new = req.output_ids[self.sent:]
        self.sent = len(req.output_ids)
        text = self.decoder.decode(bytes(t for t in new if t < 256), final=req.finished)
        self.push(GenerateOutput(text, new, req.finished, req.finish_reason, len(req.prompt_ids),
                                 len(req.output_ids), max(req.cached_tokens, 0)))


class EngineClient:
    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
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
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", _Stream(req, asyncio.get_running_loop(), sink)))
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(("abort", req.rid))

    def server_info(self) -> dict:
        return dict(self._info)

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
                for stream in self._streams.values():
                    stream.push(RuntimeError(f"engine step failed: {self.error}"))
                self._streams.clear()
                return
            for req in out or ():
                stream = self._streams.get(req.rid)
                if stream is not None:
                    stream.emit()
                    if req.finished:
                        del self._streams[req.rid]
            self._info = engine.server_info()

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
