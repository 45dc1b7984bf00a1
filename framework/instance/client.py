"""The parent's side of an engine instance (framework.instance.rank_loop): `InstanceClient` implements `EngineHandle`
for any instance, whatever runs its ranks, and `open_engine` is the one way to open one.

A reader thread turns rank 0's messages into updates of the parent's copy of each request and calls its listener.
A rank that fails or dies fails every request in flight with one message; the launcher has already stopped every
rank by then.
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

import torch

from framework.dist import RankFailed, start
from framework.engine.engine import pick_device
from framework.instance.handle import Listener
from framework.instance.local import LocalRanks
from framework.instance.rank_loop import (Abort, Add, Flush, Flushed, InstanceSpec, Outputs, Ready, Rejected, Stop,
                                       TokenOut, TransferFailed, build_rank_engine, serve_rank)
from framework.engine.request import Req
from framework.engine.scheduler import check_admissible
from framework.engine.stats import instance_stats
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


def open_engine(spec: InstanceSpec, fn=serve_rank) -> "InstanceClient | None":
    """A handle on a new instance: one rank in a thread of this process, `parallel.size` spawned ranks, or under
    torchrun this process's rank. There, ranks > 0 serve in this call until rank 0 stops the instance, then get
    None (they have nothing to report)."""
    from framework.instance import torchrun as tr
    if not tr.under_torchrun():
        if spec.parallel.size == 1 and fn is serve_rank:
            from framework.dist.group import Group
            return local_client(build_rank_engine(spec, Group(), Group()))
        par = spec.parallel
        return InstanceClient(start(fn, par.size, spec, backend=pick_backend(spec), master_port=par.master_port or None,
                                    timeout_s=par.timeout_s), ByteTokenizer(spec.model.vocab_size))
    group = tr.join_group(spec, pick_backend(spec, int(os.environ.get("LOCAL_WORLD_SIZE", spec.parallel.size))))
    if group.rank != 0:
        tr.serve_other_rank(group, fn, spec)
        return None
    return InstanceClient(tr.TorchrunRanks(group, fn, spec), ByteTokenizer(spec.model.vocab_size))


def local_client(engine) -> "InstanceClient":
    """A built engine as a one-rank instance in this process, behind the same seam as any other instance."""
    return InstanceClient(LocalRanks(engine), engine.tokenizer)


def failure_message(exc: BaseException) -> str:
    """One line: which rank failed and why (RankFailed's own text carries the traceback too)."""
    if isinstance(exc, RankFailed):
        return f"rank {exc.rank} failed: {exc.exc_type}: {exc.exc_message}"
    return f"{type(exc).__name__}: {exc}"


class InstanceClient:
    """`instance`: what runs the ranks (framework.dist's started RankProcesses, a TorchrunRanks, a LocalRanks),
    with send / recv / join / terminate; its rank 0 speaks framework.instance.rank_loop's messages."""

    @property
    def local_engine(self):
        """The engine when the instance is one rank in this process (its radix cache can publish KV events), else
        None: a multi-rank instance's engines live in its rank processes."""
        return self.instance.engine if isinstance(self.instance, LocalRanks) else None

    def __init__(self, instance, tokenizer, ready_timeout_s: float = STARTUP_TIMEOUT_S):
        self.instance, self.tokenizer = instance, tokenizer
        self._cond = threading.Condition()
        self._reqs: dict[str, tuple[Req, Listener]] = {}   # in flight: the parent's copy of each request
        self._flushes: dict[int, asyncio.Future] = {}
        self._stats: dict = {}
        self._readies = self._readies_seen = 0
        self._closed = False
        self.failure: BaseException | None = None
        self.error: str | None = None            # set when the instance failed: the worker reports unhealthy
        self.on_kv_events = None                 # InstanceSpec.kv_events_block_size: gets each KVEventBatch (the
                                                 # reader thread calls it; the worker's publisher queues it)
        self._reader = threading.Thread(target=self._read, name="instance-reader", daemon=True)
        self._reader.start()
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.instance.terminate()
            raise

    # -- EngineHandle -----------------------------------------------------------------------------------------
    def submit(self, req: Req, listener: Listener, dp_rank: int | None = None) -> None:
        self.submit_together([(req, listener, dp_rank)])

    def submit_together(self, items: list[tuple[Req, Listener, int | None]]) -> None:
        """Queue several requests (req, listener, dp_rank) in one message: rank 0 takes them in at one step, as an
        engine in this process takes the requests added before its next step (mode=verify's rounds), wherever the
        scheduler puts this process between them. Raises before sending any when one can never run."""
        if self.error is not None:
            raise RuntimeError(f"engine is down: {self.error}")
        for req, _, _ in items:
            check_admissible(req, self._stats.get("kv_capacity_tokens_per_rank"))   # a hopeless request fails here
        with self._cond:
            for req, listener, _ in items:
                self._reqs[req.rid] = (req, listener)
        self._send([Add(req.rid, req.prompt_ids, req.params, req.arrival_time, dp_rank, pairing=req.pairing)
                    for req, _, dp_rank in items])

    def abort(self, rid: str) -> None:
        with self._cond:
            self._reqs.pop(rid, None)
        with contextlib.suppress(Exception):     # a dead instance has nothing left to abort
            self._send(Abort(rid))

    def stats(self) -> dict:
        return dict(self._stats)

    async def flush_cache(self) -> bool:
        token = next(_flush_ids)
        done = asyncio.get_running_loop().create_future()
        self._flushes[token] = done
        self._send(Flush(token))
        return await done

    def close(self, timeout: float = 60.0) -> dict:
        """Stop every rank; returns the instance's final stats. Raises when a rank fails while closing; an instance
        that had already failed (its requests were told) is just cleaned up and returns {}."""
        ranks = self.close_ranks(timeout)
        return instance_stats(ranks, ranks[0]["instance_peak_running"]) if ranks else {}

    # -- lifetime -----------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> dict:
        """Wait for the next Ready (one at start; verify: one per case). Returns the instance's stats."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._readies > self._readies_seen or self.failure, timeout):
                raise TimeoutError(f"the instance was not ready within {timeout} s")
            self._raise_if_failed()
            self._readies_seen += 1
            return dict(self._stats)

    def stop_loop(self) -> None:
        """End the ranks' serving loop (verify: the current case)."""
        self._send(Stop())

    def close_ranks(self, timeout: float = 60.0) -> list:
        """Stop every rank and return what each returned, in rank order ([] when the instance had failed or was
        closed before)."""
        if self.failure is not None or self._closed:
            self.instance.terminate()
            return []
        self._closed = True
        try:
            self.stop_loop()
            self._reader.join(timeout)       # ends when every rank has returned (or one failed)
            self._raise_if_failed()
            return self.instance.join(timeout)
        finally:
            self.instance.terminate()
            if self.failure is None:         # nothing waits forever: what was still in flight is told
                self._fail_pending("the instance was closed")

    def terminate(self) -> None:
        self.instance.terminate()

    # -- internals ----------------------------------------------------------------------------------------
    def _send(self, msg) -> None:
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
            return                                  # every rank returned (after Stop)
        except BaseException as e:                  # noqa: BLE001 - RankFailed above all: fail what is in flight
            self._fail(e)

    def _dispatch(self, msg) -> None:
        with self._cond:
            if isinstance(msg, Outputs):
                now = time.perf_counter()
                if msg.stats is not None:           # first: whoever a finish wakes reads stats that count it
                    self._stats = msg.stats
                if self.on_kv_events is not None:   # before the tokens: a router sees a finished turn's blocks
                    for batch in msg.kv_events:     # stored as early as the worker can tell it
                        self.on_kv_events(batch)
                for event in msg.events:
                    self._event(event, now)
            elif isinstance(msg, Ready):
                self._stats = msg.stats
                self._readies += 1
            elif isinstance(msg, Flushed):
                future = self._flushes.pop(msg.token, None)
                if future is not None:
                    future.get_loop().call_soon_threadsafe(future.set_result, msg.ok)
            self._cond.notify_all()

    def _event(self, event: TokenOut | Rejected | TransferFailed, now: float) -> None:
        entry = self._reqs.get(event.rid)
        if entry is None:
            return                                  # aborted meanwhile
        req, listener = entry
        if isinstance(event, Rejected):
            del self._reqs[event.rid]
            listener(req, ValueError(event.error))
            return
        if isinstance(event, TransferFailed):
            del self._reqs[event.rid]
            listener(req, RuntimeError(f"KV transfer failed: {event.error}"))
            return
        if event.n_out != len(req.output_ids) + 1:
            log.warning("request %s: token %d arrived after %d", event.rid, event.n_out, len(req.output_ids))
        req.output_ids.append(event.token)
        req.cached_tokens = event.cached_tokens
        req.kv_transfer_bytes, req.kv_transfer_s = event.kv_transfer_bytes, event.kv_transfer_s
        if req.first_token_time is None:
            req.first_token_time, req.engine_ttft_s = now, event.engine_ttft_s
        if event.finish_reason is not None:
            req.finish_reason, req.finish_time = event.finish_reason, now
            del self._reqs[event.rid]
        listener(req, None)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        log.debug("instance failed: %s", exc)       # the caller reports it (bench: one line; worker: .error)
        self._fail_pending(failure_message(exc))

    def _fail_pending(self, why: str) -> None:
        with self._cond:
            self.error = self.error or why
            for req, listener in self._reqs.values():
                listener(req, RuntimeError(f"engine is down: {self.error}"))
            self._reqs.clear()
            for future in self._flushes.values():
                future.get_loop().call_soon_threadsafe(future.set_exception, RuntimeError(self.error))
            self._flushes.clear()
            self._cond.notify_all()
