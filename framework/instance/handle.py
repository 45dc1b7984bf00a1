"""The one engine seam: `EngineHandle`, what every caller of an engine instance talks to, whatever its ranks.

Implemented by `InstanceClient` (framework.instance.client: one rank in a thread of this process, spawned
ranks, or torchrun's rank 0) and later by a simulated instance. Two faces are built once over any handle:
`generate` (async, for the HTTP worker: text deltas, stop strings, abort when the caller stops reading) and
`SyncFace` (add / step, for the in-process bench driver and mode=verify).
"""
from __future__ import annotations

import asyncio
import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Protocol

from framework.engine.request import Req, SamplingParams

# Called by the handle, from its own thread, after each update of a request it holds (`exc` None: `req` got tokens
# or finished, updated in place) or when the request failed (`exc`: ValueError for a request that can never run,
# RuntimeError when the instance died).
Listener = Callable[[Req, Optional[Exception]], None]


class EngineHandle(Protocol):
    tokenizer: object             # encode / decode
    error: str | None             # set once the instance failed (the worker then reports unhealthy)

    def submit(self, req: Req, listener: Listener, dp_rank: int | None = None) -> None:
        """Queue `req` (ValueError at once when it can never run); `dp_rank` pins it to a DP group."""

    def submit_together(self, items: list[tuple[Req, Listener, Optional[int]]]) -> None:
        """Queue several (req, listener, dp_rank) so that the instance takes them in at one step."""

    def abort(self, rid: str) -> None:
        """Drop a request; its listener hears nothing more."""

    def stats(self) -> dict:
        """The instance's latest statistics (framework.engine.stats.instance_stats)."""

    async def flush_cache(self) -> bool:
        """Empty the radix caches; False (nothing done) while requests are in flight."""

    def close(self) -> dict:
        """Stop the instance; returns its final statistics ({} when it had failed)."""


class EngineDown(RuntimeError):
    """The instance failed; the message names the rank and the cause."""


@dataclass
class GenerateOutput:
    text: str                              # new text since the previous output
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None       # stop | length | abort
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_transfer_bytes: int = 0             # disaggregated (decode side): what the request's KV transfer moved
    kv_transfer_s: float = 0.0
    engine_ttft_s: float | None = None     # its arrival at the engine to its first token, as the engine's scheduler
                                           # stamped it (Req.engine_ttft_s; None: none yet)


class Stream:
    """Per-request delivery to an asyncio loop: an incremental UTF-8 decoder, and text held back while it could
    still turn out to be the start of a stop string (a stop string is cut from the returned text)."""

    def __init__(self, req: Req, loop: asyncio.AbstractEventLoop):
        self.req, self.loop, self.sink, self.sent = req, loop, asyncio.Queue(), 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""

    def listen(self, req: Req, exc: Exception | None) -> None:
        if exc is not None:
            self.push(exc)
        else:
            self.emit()

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
                                 len(req.output_ids), max(req.cached_tokens, 0), req.kv_transfer_bytes,
                                 req.kv_transfer_s, req.engine_ttft_s))


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


async def generate(handle: EngineHandle, prompt: str | list[int], params: SamplingParams,
                   dp_rank: int | None = None, pairing=None) -> AsyncIterator[GenerateOutput]:
    """Yields incremental outputs; the last has finished=True. Raises ValueError for a request that can never be
    served. Stopping the iteration early (a client that left) aborts the request. `pairing`: a prefill/decode
    instance's half of a disaggregated request (framework.engine.disagg.Pairing)."""
    ids = handle.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    req = Req(ids, params, pairing=pairing)
    stream = Stream(req, asyncio.get_running_loop())
    handle.submit(req, stream.listen, dp_rank)
    finished = False
    try:
        async for item in stream.outputs():
            finished = item.finished
            yield item
    finally:
        if not finished:
            handle.abort(req.rid)


class SyncFace:
    """add / step over a handle, for callers that drive requests from one thread (framework.load.inprocess,
    mode=verify): `step()` returns the requests that got tokens since the last call."""

    def __init__(self, handle: EngineHandle):
        self.handle, self.tokenizer = handle, handle.tokenizer
        self._cond = threading.Condition()
        self._updated: dict[str, Req] = {}
        self._failure: Exception | None = None

    def _listen(self, req: Req, exc: Exception | None) -> None:
        with self._cond:
            if exc is None:
                self._updated[req.rid] = req
            else:
                req.finish_reason, req.finish_time = "error", time.perf_counter()
                self._failure = self._failure or exc
            self._cond.notify_all()

    def add(self, req: Req, dp_rank: int | None = None) -> None:
        """Queue a request (ValueError when it can never be served). `dp_rank` pins it to a DP group."""
        self.handle.submit(req, self._listen, dp_rank)

    def add_together(self, reqs: list[Req], dp_ranks: list[int | None]) -> None:
        """Queue requests that the instance takes in at one step (`add`'s, each with its pin)."""
        self.handle.submit_together([(r, self._listen, dp) for r, dp in zip(reqs, dp_ranks, strict=True)])

    def step(self, timeout: float = 0.05) -> list[Req] | None:
        """The requests that got tokens since the last call (None after `timeout` s without any). Raises when a
        request failed or the instance died."""
        with self._cond:
            if not self._updated and self._failure is None and self.handle.error is None:
                self._cond.wait(timeout)
            if self.handle.error is not None:
                raise EngineDown(self.handle.error)
            if self._failure is not None:
                raise self._failure
            out, self._updated = list(self._updated.values()), {}
        return out or None

    def wait_all(self, reqs: list[Req], timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(r.finished for r in reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not r.finished for r in reqs)} request(s) unfinished after {timeout} s")
            self.step()
