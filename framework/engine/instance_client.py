"""The parent's side of a multi-rank instance (framework.engine.instance).

`InstanceClient` has EngineClient's async interface (`generate`, `server_info`, `flush_cache`, `close`, `error`), so
the HTTP worker can front a multi-rank instance as it fronts one engine, and a synchronous `add` / `step` face that
the in-process bench driver (framework.workload.inprocess.play) and mode=verify use. A reader thread turns rank 0's
messages into updates of the parent's copy of each request. A rank that fails or dies fails every request in flight
with one message; the launcher has already stopped every rank by then.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import warnings
from typing import AsyncIterator

import torch

from framework.dist import RankFailed, start
from framework.engine.scheduler import check_admissible
from framework.engine.client import GenerateOutput, Stream
from framework.engine.engine import pick_device
from framework.engine.instance import InstanceSpec, serve_rank
from framework.engine.request import Req, SamplingParams
from framework.model.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 180.0
_flush_ids = itertools.count()


def pick_backend(spec: InstanceSpec, local_ranks: int | None = None) -> str:
    """NCCL when the engine runs on CUDA with a GPU per local rank, else gloo on CPU (an explicit parallel.backend
    or engine.device=cuda is taken at its word, and the launcher says what is missing)."""
    if spec.parallel.backend != "auto":
        return spec.parallel.backend
    if pick_device(spec.engine.device).type != "cuda":
        return "gloo"
    gpus, local_ranks = torch.cuda.device_count(), local_ranks or spec.parallel.size
    if gpus >= local_ranks or spec.engine.device == "cuda":
        return "nccl"
    warnings.warn(f"{local_ranks} local ranks but {gpus} GPU(s) visible: the instance runs on CPU with gloo "
                  "(set engine.device=cpu to say so)", RuntimeWarning, stacklevel=2)
    return "gloo"


def open_client(spec: InstanceSpec, fn=serve_rank) -> "InstanceClient | None":
    """A client of a new instance: `parallel.size` spawned ranks, or under torchrun this process's rank. There,
    ranks > 0 serve in this call until rank 0 stops the instance, then get None (they have nothing to report)."""
    from framework.engine import torchrun_instance as tr
    if not tr.under_torchrun():
        return InstanceClient(spec, fn)
    group = tr.join_group(spec, pick_backend(spec, int(os.environ.get("LOCAL_WORLD_SIZE", spec.parallel.size))))
    if group.rank != 0:
        tr.serve_other_rank(group, fn, spec)
        return None
    return InstanceClient(spec, fn, instance=tr.TorchrunInstance(group, fn, spec))


def failure_message(exc: BaseException) -> str:
    """One line: which rank failed and why (RankFailed's own text carries the traceback too)."""
    if isinstance(exc, RankFailed):
        return f"rank {exc.rank} failed: {exc.exc_type}: {exc.exc_message}"
    return f"{type(exc).__name__}: {exc}"


class InstanceClient:
    def __init__(self, spec: InstanceSpec, fn=serve_rank, ready_timeout_s: float = STARTUP_TIMEOUT_S, instance=None):
        """Spawns `parallel.size` ranks running `fn`, unless `instance` (torchrun: rank 0's own loop) is given."""
        self.spec = spec
        self.tokenizer = ByteTokenizer(spec.model.vocab_size)
        par = spec.parallel
        self.instance = instance or start(fn, par.size, spec, backend=pick_backend(spec),
                                          master_port=par.master_port or None, timeout_s=par.timeout_s)
        self._cond = threading.Condition()
        self._reqs: dict[str, Req] = {}          # in flight: the parent's copy of each request
        self._streams: dict[str, Stream] = {}   # in flight through generate()
        self._updated: list[Req] = []            # requests that got a token since the last step() (sync face)
        self._flushes: dict[int, asyncio.Future] = {}
        self._info: dict = {}
        self._readies = self._readies_seen = 0
        self.failure: BaseException | None = None
        self.error: str | None = None            # set when the instance failed: the worker reports unhealthy
        self._reader = threading.Thread(target=self._read, name="instance-reader", daemon=True)
        self._reader.start()
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.instance.terminate()
            raise

    # -- lifetime -----------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> dict:
        """Wait for the next "ready" (one at start; verify: one per case). Returns the instance's info."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._readies > self._readies_seen or self.failure, timeout):
                raise TimeoutError(f"the instance was not ready within {timeout} s")
            self._raise_if_failed()
            self._readies_seen += 1
            return dict(self._info)

    def stop_loop(self) -> None:
        """End the ranks' serving loop (verify: the current case)."""
        self._send(("stop",))

    def close(self, timeout: float = 60.0) -> list[dict]:
        """Stop every rank and return their statistics, in rank order. Raises when a rank fails while closing; an
        instance that had already failed (its requests were told) is just cleaned up and returns []."""
        if self.failure is not None:
            self.instance.terminate()
            return []
        try:
            self.stop_loop()
            self._reader.join(timeout)       # ends when every rank has returned (or one failed)
            self._raise_if_failed()
            return self.instance.join(timeout)
        finally:
            self.instance.terminate()

    def terminate(self) -> None:
        self.instance.terminate()

    def __enter__(self) -> "InstanceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()

    # -- synchronous face (bench driver, verify) ----------------------------------------------------------
    def add(self, req: Req, dp_rank: int | None = None) -> None:
        """Queue a request (ValueError when it can never be served). `dp_rank` pins it to a DP rank."""
        self._check(req)
        with self._cond:
            self._reqs[req.rid] = req
        self._send(("add", req.rid, req.prompt_ids, req.params, req.arrival_time, dp_rank))

    def step(self, timeout: float = 0.05) -> list[Req] | None:
        """The requests that got tokens since the last call, each once (None after `timeout` s without any)."""
        with self._cond:
            if not self._updated and self.failure is None:
                self._cond.wait(timeout)
            self._raise_if_failed()
            out, self._updated = list(dict.fromkeys(self._updated)), []
        return out or None

    def wait_all(self, reqs: list[Req], timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(r.finished for r in reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not r.finished for r in reqs)} request(s) unfinished after {timeout} s")
            self.step()

    # -- async face (EngineClient's interface) ------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       dp_rank: int | None = None) -> AsyncIterator[GenerateOutput]:
        """Yields incremental outputs; the last has finished=True. Cancelling the iteration aborts the request."""
        if self.error is not None:
            raise RuntimeError(f"engine is down: {self.error}")
        req = Req(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), params)
        self._check(req)
        stream = Stream(req, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            self._reqs[req.rid] = req
            self._streams[req.rid] = stream
        self._send(("add", req.rid, req.prompt_ids, req.params, req.arrival_time, dp_rank))
        finished = False
        try:
            async for item in stream.outputs():
                finished = item.finished
                yield item
        finally:
            if not finished:
                with self._cond:
                    self._reqs.pop(req.rid, None)
                    self._streams.pop(req.rid, None)
                with contextlib.suppress(Exception):   # a dead instance has nothing left to abort
                    self._send(("abort", req.rid))

    def server_info(self) -> dict:
        return dict(self._info)

    async def flush_cache(self) -> bool:
        token = next(_flush_ids)
        done = asyncio.get_running_loop().create_future()
        self._flushes[token] = done
        self._send(("flush", token))
        return await done

    # -- internals ----------------------------------------------------------------------------------------
    def _check(self, req: Req) -> None:
        """The admission checks of Scheduler.add, here, so a hopeless request fails at once and in this process."""
        check_admissible(req, self._info.get("kv_capacity_tokens_per_rank"))

    def _send(self, msg: tuple) -> None:
        self._raise_if_failed()
        try:
            self.instance.send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise RuntimeError(f"the instance is gone ({self.error or e})") from None

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self.instance.recv())
        except EOFError:
            return                                  # every rank returned (after "stop")
        except BaseException as e:                  # noqa: BLE001 - RankFailed above all: fail what is in flight
            self._fail(e)

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        with self._cond:
            if kind == "ready":
                self._info = msg[1]
                self._readies += 1
            elif kind == "out":
                now = time.perf_counter()
                for rec in msg[1]:
                    self._record(rec, now)
                if msg[2] is not None:
                    self._info = msg[2]
            elif kind == "flushed":
                future = self._flushes.pop(msg[1], None)
                if future is not None:
                    future.get_loop().call_soon_threadsafe(future.set_result, msg[2])
            self._cond.notify_all()

    def _record(self, rec: tuple, now: float) -> None:
        rid = rec[1]
        req = self._reqs.get(rid)
        if req is None:
            return                                  # aborted meanwhile
        stream = self._streams.get(rid)
        if rec[0] == "reject":
            del self._reqs[rid]
            if stream is not None:
                del self._streams[rid]
                stream.push(ValueError(rec[2]))
            else:
                req.finish_reason, req.finish_time = "error", now
                self.failure = self.failure or RuntimeError(f"request {rid} was rejected by the instance: {rec[2]}")
            return
        _, _, n_out, token, reason, cached = rec
        if n_out != len(req.output_ids) + 1:
            log.warning("request %s: token %d arrived after %d", rid, n_out, len(req.output_ids))
        req.output_ids.append(token)
        req.cached_tokens = cached
        if req.first_token_time is None:
            req.first_token_time = now
        if reason is not None:
            req.finish_reason, req.finish_time = reason, now
            del self._reqs[rid]
        if stream is not None:
            stream.emit()
            if reason is not None:
                del self._streams[rid]
        else:
            self._updated.append(req)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure, self.error = exc, failure_message(exc)
            log.debug("instance failed: %s", self.error)   # the caller reports it (bench: one line; worker: .error)
            for stream in self._streams.values():
                stream.push(RuntimeError(f"engine is down: {self.error}"))
            self._streams.clear()
            for future in self._flushes.values():
                future.get_loop().call_soon_threadsafe(future.set_exception, RuntimeError(self.error))
            self._flushes.clear()
            self._cond.notify_all()
