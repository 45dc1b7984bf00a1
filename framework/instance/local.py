"""A one-rank instance in this process: the rank loop (framework.instance.rank_loop) steps a built `Engine` in a
background thread; the same InstanceClient fronts it as any multi-rank instance, so one rank and many share one seam."""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

from framework.dist.group import Group
from framework.engine.engine import Engine
from framework.instance.rank_loop import RankLoop, Stop

log = logging.getLogger(__name__)


class _Pipe:
    """One end of a pair of in-process queues, with the launch channel's send / poll / recv. Messages are not
    copied: each side only reads what the other sent."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox, self._peeked = inbox, outbox, []

    def send(self, obj: Any) -> None:
        self.outbox.put(obj)

    def poll(self, timeout: float = 0.0) -> bool:
        if not self._peeked:
            try:
                self._peeked.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
            except queue.Empty:
                return False
        return True

    def recv(self) -> Any:
        item = self._peeked.pop() if self._peeked else self.inbox.get()
        if item is EOFError:
            raise EOFError
        return item


class ThreadRanks:
    """A rank loop on a thread of this process, with framework.dist's RankProcesses interface (send / recv / join /
    terminate): what the loop raised reaches the driver through `recv`, after the outputs sent before it, and `join`.
    A subclass starts `_thread`, whose target sets `_results` or `_error` and then ends `_channel`'s other side."""

    _channel: Any
    _thread: threading.Thread
    _results: list | None = None
    _error: BaseException | None = None
    _stuck = "the rank loop did not finish"     # join's timeout message

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def recv(self, timeout: float | None = None) -> Any:
        if timeout is not None and not self._channel.poll(timeout):
            raise TimeoutError(f"no message from rank 0's loop within {timeout} s")
        try:
            return self._channel.recv()
        except EOFError:
            self._thread.join()
            if self._error is not None:
                raise self._error from None
            raise

    def join(self, timeout: float | None = None) -> list:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._stuck} within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._results


class LocalRanks(ThreadRanks):
    """The rank loop of one engine in a thread."""

    _stuck = "the engine thread did not stop"

    def __init__(self, engine: Engine):
        self.engine = engine            # read by this process's worker (its radix cache publishes KV events)
        down, up = queue.Queue(), queue.Queue()
        self._channel, rank_side = _Pipe(up, down), _Pipe(down, up)
        self._thread = threading.Thread(target=self._run, args=(engine, rank_side), name="engine", daemon=True)
        self._thread.start()

    def _run(self, engine: Engine, channel: _Pipe) -> None:
        try:
            loop = RankLoop(engine, Group(), channel)
            self._results = [{**loop.run(), "instance_peak_running": loop.peak_running}]
        except BaseException as e:               # noqa: BLE001 - a dead engine must fail its requests, not hang them
            log.exception("engine step failed")
            self._error = e
        finally:
            channel.send(EOFError)

    def send(self, obj: Any) -> None:
        if not self._thread.is_alive():
            raise BrokenPipeError("the engine thread has stopped")
        self._channel.send(obj)

    def terminate(self) -> None:
        if self._thread.is_alive():
            self._channel.send(Stop())
