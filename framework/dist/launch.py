"""Launch an instance's ranks: `launch` runs a function on every rank and returns their results; `start` keeps an
instance running and gives the parent a channel to rank 0 (the serving layer's HTTP server feeds rank 0's scheduler).

Ranks are started locally with torch.multiprocessing: start method "spawn" by default, or "forkserver" (ranks forked
from a server that imported torch once: a launch takes ~0.2 s instead of seconds per rank; tests and sweeps of many
small launches want it; `SERVELAB_START_METHOD` sets the default). When a rank fails, the launcher raises
ONE `RankFailed` naming the rank, its exception and its traceback, and stops every other rank: no orphans, also when a
rank dies abruptly or the parent gets Ctrl-C. Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) `launch` runs the
function in-process on this rank instead, so the same code runs multi-node with NCCL.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch.multiprocessing as mp

from framework.core.ports import free_ports
from framework.dist.group import DEFAULT_TIMEOUT_S
from framework.dist.rank import (
    PortInUse,
    port_in_use_message,
    resolve_backend,
    run_torchrun_rank,
    spawned_rank_main,
    torchrun_env,
)

STARTUP_TIMEOUT_S = 120.0  # how long ranks wait for each other at rendezvous (spawning takes seconds per rank)
FAILURE_GRACE_S = 0.5  # after a first failure, how long to collect other ranks' reports to find the root cause
EXIT_GRACE_S = 10.0  # how long finished ranks get to exit before they are killed
START_METHODS = ("spawn", "forkserver")


class RankFailed(RuntimeError):
    """A rank raised or died. Attributes: rank, exc_type, exc_message, traceback_text ("" when it died abruptly)."""

    def __init__(self, rank: int, exc_type: str, exc_message: str, traceback_text: str, others: list[str]):
        self.rank, self.exc_type, self.exc_message, self.traceback_text = rank, exc_type, exc_message, traceback_text
        text = f"rank {rank} failed: {exc_type}: {exc_message}"
        if others:
            text += "\n(then: " + "; ".join(others) + ")"
        if traceback_text:
            text += f"\n\n--- traceback from rank {rank} ---\n{traceback_text.rstrip()}"
        super().__init__(text)


class Channel:
    """One end of a two-way pipe that carries picklable objects (parent <-> rank 0 of a started instance).

    Objects travel as plain pickles (tensors are copied), not through torch.multiprocessing's shared-memory
    reductions, which need the sending process alive until the receiver has read them.
    """

    def __init__(self, conn: Connection):
        self._conn = conn
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()

    def __reduce__(self):  # travels to rank 0 as its connection; the locks are per process
        return (Channel, (self._conn,))

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message is ready (or the other end closed, so that recv raises EOFError)."""
        return self._conn.poll(timeout)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; TimeoutError after `timeout` s; EOFError once the other end has closed."""
        with self._recv_lock:
            if timeout is not None and not self._conn.poll(timeout):
                raise TimeoutError(f"no message within {timeout} s")
            return pickle.loads(self._conn.recv_bytes())

    def fileno(self) -> int:
        """For event loops (asyncio's add_reader): readable when `recv` will not block."""
        return self._conn.fileno()

    def close(self) -> None:
        self._conn.close()


class RankProcesses:
    """The running ranks of one instance. Use as a context manager, or call `join` / `terminate`."""

    def __init__(self, processes: list[Any], reports: list[Connection], channel: Channel | None, lifeline: Connection):
        self._processes, self._reports, self._channel = processes, reports, channel
        self._lifeline = lifeline  # ranks exit when this closes (see rank._exit_when_launcher_dies)
        self._outcome: dict[int, dict] = {}  # rank -> its report, or a synthetic one when it died without reporting
        self._lock = threading.RLock()
        # terminate() runs in two threads at once when the owner stops the instance while a reader thread sits in
        # recv(): the ranks it kills read as deaths there, and _raise_if_failed tears down too. Connection.close is
        # not thread-safe (check, os.close, then forget the handle), so both could os.close one descriptor: EBADF,
        # or worse, closing whatever file took that number in between. One teardown at a time.
        self._teardown = threading.Lock()
        self._terminated = False
        self._failure: RankFailed | None = None  # raised again by every later call

    @property
    def size(self) -> int:
        return len(self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def alive(self) -> bool:
        """True while every rank is still running."""
        return all(p.is_alive() for p in self._processes)

    # ------------------------------------------------------------ talking to rank 0

    def send(self, obj: Any) -> None:
        """Send a picklable object to rank 0 (its fn received the other end as its `channel` argument)."""
        self._need_channel().send(obj)

    def recv(self, timeout: float | None = None) -> Any:
        """The next object rank 0 sent. Raises RankFailed when a rank failed first, TimeoutError after `timeout` s,
        EOFError when rank 0 returned without sending more."""
        channel = self._need_channel()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if channel.poll(0):
                try:
                    return channel.recv()
                except EOFError:  # rank 0 exited: report its failure if it failed
                    self._collect_until(lambda: 0 in self._outcome, deadline=time.monotonic() + EXIT_GRACE_S)
                    self._raise_if_failed()
                    raise EOFError("rank 0 has returned; the instance sends no more messages") from None
            self._raise_if_failed()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no message from rank 0 within {timeout} s")
            waiting = [channel._conn] + [self._reports[r] for r in range(self.size) if r not in self._outcome]
            for ready in wait(waiting, timeout=left):
                if ready is not channel._conn:
                    self._collect_ready([ready])

    def fileno(self) -> int:
        return self._need_channel().fileno()

    # ------------------------------------------------------------ lifetime

    def join(self, timeout: float | None = None) -> list[Any]:
        """Wait for every rank's return value (in rank order). On the first failure, stop all ranks and raise
        RankFailed. TimeoutError after `timeout` s (the ranks keep running; call terminate)."""
        self._need_running()
        deadline = None if timeout is None else time.monotonic() + timeout
        done = lambda: len(self._outcome) == self.size or self._failed()  # noqa: E731
        if not self._collect_until(done, deadline):
            raise TimeoutError(f"the instance's {self.size} ranks did not finish within {timeout} s")
        self._raise_if_failed()
        for p in self._processes:  # every rank reported; give them a moment to exit, then make sure
            p.join(EXIT_GRACE_S)
        self.terminate()
        return [self._outcome[r]["result"] for r in range(self.size)]

    def terminate(self) -> None:
        """Stop every rank still running (SIGTERM, then SIGKILL) and reap it. Safe to call more than once, and from
        several threads (one tears down, the others wait for it)."""
        with self._teardown:
            self._terminated = True
            for p in self._processes:
                if p.is_alive():
                    p.terminate()
            for p in self._processes:
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join()
            with self._lock:   # not while _collect_ready reads a report (its number could be reused meanwhile)
                self._lifeline.close()
                if self._channel is not None:
                    self._channel.close()
                for conn in self._reports:
                    conn.close()

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    # ------------------------------------------------------------ collecting reports

    def _need_channel(self) -> Channel:
        if self._channel is None:
            raise RuntimeError("this instance has no channel to rank 0; create it with start(), not launch()")
        self._need_running()
        return self._channel

    def _need_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._terminated and len(self._outcome) < self.size:
            raise RuntimeError("this instance was terminated; start a new one")

    def _failed(self) -> bool:
        return any(o["status"] != "ok" for o in self._outcome.values())

    def _collect_ready(self, ready: list[Any]) -> None:
        with self._lock:
            for rank in range(self.size):
                conn = self._reports[rank]
                if rank in self._outcome or conn.closed:
                    continue
                if conn in ready or conn.poll(0):
                    try:
                        data = conn.recv_bytes()
                    except (EOFError, OSError):  # closed without a report: the rank died abruptly
                        self._processes[rank].join(1.0)
                        self._outcome[rank] = _death_report(rank, self._processes[rank].exitcode)
                        continue
                    self._outcome[rank] = pickle.loads(data)

    def _collect_until(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Read reports until done() (True) or the deadline (False)."""
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            pending = [self._reports[r] for r in range(self.size) if r not in self._outcome]
            self._collect_ready(wait(pending, timeout=left))
        return True

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if not self._failed():
            return
        # Let the other ranks' reports arrive: a rank that died first makes its peers' collectives fail next.
        grace = time.monotonic() + FAILURE_GRACE_S
        self._collect_until(lambda: len(self._outcome) == self.size, grace)
        self.terminate()
        failures = [o for o in self._outcome.values() if o["status"] != "ok"]
        # Root cause first: an ordinary exception, then an abrupt death, then a collective failure (a symptom).
        failures.sort(key=lambda o: (2 if o["collective"] else int(o["status"] == "died"), o["time"]))
        first, rest = failures[0], failures[1:]
        others = [f"rank {o['rank']}: {o['exc_type']}" for o in rest]
        self._failure = RankFailed(first["rank"], first["exc_type"], first["message"], first["traceback"], others)
        raise self._failure


def _death_report(rank: int, exitcode: int | None) -> dict:
    if exitcode is not None and exitcode < 0:
        how = f"killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exit code {exitcode}"
    return {
        "status": "died", "rank": rank, "exc_type": "RankDied", "time": time.time(), "collective": False,
        "message": f"rank {rank} exited without reporting ({how}; its stderr, if any, is above); "
        "the other ranks were stopped",
        "traceback": "",
    }


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is not "in use"
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise PortInUse(port_in_use_message(port)) from exc


def _context(start_method: str | None) -> Any:
    """The multiprocessing context. "forkserver" forks ranks from a server that imported torch once, so every launch
    after the first starts in a fraction of a second instead of seconds per rank (spawn re-imports torch)."""
    method = start_method or os.environ.get("SERVELAB_START_METHOD", "spawn")
    if method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} (or None), got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":  # neither import initialises CUDA, so forked ranks may still pick their GPU
        ctx.set_forkserver_preload(["torch", "framework.dist.rank"])
    return ctx


def _spawn(fn, size, args, backend, master_port, timeout_s, startup_timeout_s, start_method, channel) -> RankProcesses:
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    backend = resolve_backend(backend, size)
    cores = os.cpu_count() or 1
    if backend == "gloo" and size > cores:
        warnings.warn(
            f"launching {size} ranks on {cores} CPU cores: ranks time-share cores, so collectives are slow; "
            "raise timeout_s if they time out",
            RuntimeWarning,
            stacklevel=3,
        )
    if master_port is None:  # chosen outside the ephemeral range: no outgoing connection takes it before rank 0 binds
        master_port = free_ports("127.0.0.1", 1)[0]
    else:
        _check_port_free(master_port)
    url = f"tcp://127.0.0.1:{master_port}"
    ctx = _context(start_method)
    # A forkserver's ranks inherit the server's environment, not ours: send ours along.
    env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    parent_end = rank0_end = None
    if channel:
        parent_end, rank0_end = ctx.Pipe(duplex=True)
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
    processes, reports = [], []
    instance = RankProcesses(processes, reports, Channel(parent_end) if channel else None, lifeline_w)
    try:
        for rank in range(size):
            reader, writer = ctx.Pipe(duplex=False)
            # Only rank 0 gets the channel's far end, so the parent reads EOF as soon as rank 0 is gone.
            rank0_channel = Channel(rank0_end) if channel and rank == 0 else None
            rank_args = (backend, url, timeout_s, startup_timeout_s, writer, channel, rank0_channel, lifeline_r, env)
            proc = ctx.Process(
                target=spawned_rank_main,
                args=(rank, size, fn, args, *rank_args),
                name=f"servelab-rank{rank}",
                daemon=True,
            )
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:  # fn or an argument cannot be pickled
                raise TypeError(
                    f"could not start rank {rank}: {exc}. fn must be a module-level function and args picklable "
                    "(spawned ranks import fn by name)"
                ) from exc
            finally:
                writer.close()  # the parent keeps only the read end, so a dead rank reads as EOF
            processes.append(proc)
            reports.append(reader)
    except BaseException:
        instance.terminate()
        raise
    finally:
        lifeline_r.close()
        if rank0_end is not None:
            rank0_end.close()
    return instance


def launch(
    fn: Callable[..., Any],
    size: int,
    *args: Any,
    backend: str = "auto",
    master_port: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(group, *args)` on `size` ranks and return their return values in rank order.

    backend: "auto" (NCCL with one GPU per rank when CUDA is available, else gloo), "gloo" or "nccl".
    master_port: the rendezvous port (a free one is picked when None). timeout_s: every collective's timeout.
    start_method: "spawn" or "forkserver" (None: $SERVELAB_START_METHOD, else "spawn"); see `_context`.
    Raises RankFailed when a rank raises or dies (after stopping all ranks). Under torchrun, runs fn on this rank
    only and returns every rank's value (gathered with all_gather_object).
    """
    if torchrun_env() is not None:
        return run_torchrun_rank(fn, size, args, backend, timeout_s, startup_timeout_s)
    instance = _spawn(fn, size, args, backend, master_port, timeout_s, startup_timeout_s, start_method, channel=False)
    try:
        return instance.join()
    finally:
        instance.terminate()  # also on KeyboardInterrupt: no rank outlives the launcher


def start(
    fn: Callable[..., Any],
    size: int,
    *args: Any,
    backend: str = "auto",
    master_port: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    start_method: str | None = None,
) -> RankProcesses:
    """Start a long-lived instance: every rank runs `fn(group, channel, *args)`, where `channel` is a `Channel` to the
    parent on rank 0 and None on the other ranks. The parent talks to rank 0 with `RankProcesses.send` / `RankProcesses.recv`.
    """
    if torchrun_env() is not None:
        raise RuntimeError("start() spawns local ranks and cannot run under torchrun; use launch() there")
    return _spawn(fn, size, args, backend, master_port, timeout_s, startup_timeout_s, start_method, channel=True)
