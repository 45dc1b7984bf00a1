"""What runs inside one rank: process-group set-up, the call of the user's function, the report, a clean exit.

Spawned ranks enter through `spawned_rank_main`; under torchrun `launch` calls `run_torchrun_rank` in-process.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from framework.dist.group import CollectiveError, Group

DESTROY_WAIT_S = 5.0  # destroy_process_group runs in a thread; give up on it after this long


class PortInUse(RuntimeError):
    """The rendezvous port is taken by another process."""


def port_in_use_message(port: int) -> str:
    return f"port {port} is in use; set master_port= to a free port (or leave it None to pick a free one)"


def resolve_backend(backend: str, local_ranks: int) -> str:
    """"auto" -> NCCL when CUDA has a GPU for every local rank, else gloo; an explicit choice is checked."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        if gpus == 0:
            return "gloo"
        backend = "nccl"
    if backend == "nccl" and gpus < local_ranks:
        raise ValueError(
            f"backend={backend!r} needs one GPU per local rank: {local_ranks} ranks, {gpus} GPUs visible; "
            "pass backend='gloo' to run on CPU"
        )
    return backend


def init_group(
    rank: int, size: int, local_rank: int, backend: str, url: str, timeout_s: float | None, startup_timeout_s: float
) -> Group:
    """Rendezvous at `url` ("tcp://host:port" or "env://"), create the process group, return this rank's Group.

    The rendezvous store waits for every rank up to `startup_timeout_s` (spawning a rank takes seconds), while the
    process group itself gets the collectives' `timeout_s`.
    """
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        device = "cpu"
    try:
        store, _, _ = next(
            dist.rendezvous(url, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=startup_timeout_s))
        )
    except RuntimeError as exc:
        text = str(exc).lower()
        if rank == 0 and ("address already in use" in text or "eaddrinuse" in text) and url.startswith("tcp://"):
            raise PortInUse(port_in_use_message(int(url.rsplit(":", 1)[1]))) from exc
        raise
    pg_timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 600.0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=pg_timeout)
    return Group(rank, size, backend, device, timeout_s, pg=dist.group.WORLD)


def shutdown(after_collective_failure: bool) -> None:
    """Destroy the process group without risking a hang.

    After a failed collective the peer's half may still be pending and destroy can block until the backend's own
    timeout, so it is skipped: the process is about to exit and the OS closes the sockets. Otherwise destroy runs in a
    daemon thread that we stop waiting for after DESTROY_WAIT_S.
    """
    if after_collective_failure or not dist.is_initialized():
        return
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True, name="destroy_process_group")
    worker.start()
    worker.join(DESTROY_WAIT_S)


def _exit_when_launcher_dies(lifeline: Any) -> None:
    """A rank whose launcher vanished (SIGKILL, crash) exits instead of lingering as an orphan.

    `lifeline` is the read end of a pipe whose only write end the launcher holds: it reads EOF once the launcher has
    exited (however it exited) or let go of the instance.
    """

    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="launcher_watch").start()


def _pickle(obj: Any) -> bytes:
    # Plain pickle copies tensors; torch.multiprocessing's shared-memory reduction would need this process alive
    # until the launcher has read the report, and the rank exits right after sending it.
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _error_report(rank: int, exc: BaseException) -> dict:
    return {
        "status": "error",
        "rank": rank,
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "time": time.time(),
        "collective": isinstance(exc, CollectiveError),
    }


def spawned_rank_main(
    rank: int,
    size: int,
    fn: Callable[..., Any],
    args: tuple,
    backend: str,
    url: str,
    timeout_s: float | None,
    startup_timeout_s: float,
    report: Any,
    takes_channel: bool,
    channel: Any,
    lifeline: Any,
    env: dict[str, str] | None,
) -> None:
    """Entry point of a spawned rank: call fn, send ONE report ({"status": "ok"|"error", ...}) on `report`, exit."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle: it stops every rank
    _exit_when_launcher_dies(lifeline)
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    failed_collective = False
    try:
        group = init_group(rank, size, rank, backend, url, timeout_s, startup_timeout_s)
        extra = (channel,) if takes_channel else ()  # start(): fn(group, channel, *args), channel None on rank > 0
        result = fn(group, *extra, *args)
        try:
            message = _pickle({"status": "ok", "rank": rank, "result": result})
        except Exception as exc:
            raise TypeError(f"rank {rank}: fn's return value cannot be pickled for the launcher: {exc}") from exc
        report.send_bytes(message)
        code = 0
    except BaseException as exc:
        failed_collective = isinstance(exc, CollectiveError)
        try:
            report.send_bytes(_pickle(_error_report(rank, exc)))
        except Exception:
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    shutdown(failed_collective)
    os._exit(code)  # skip interpreter teardown: process-group destructors can block on dead peers


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when this process was started by torchrun, else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return None


def run_torchrun_rank(
    fn: Callable[..., Any], size: int, args: tuple, backend: str, timeout_s: float | None, startup_timeout_s: float
) -> list[Any]:
    """Run fn on this torchrun rank; every rank gets every rank's return value (gathered), like `launch`."""
    rank, world, local_rank = torchrun_env()
    if world != size:
        raise ValueError(f"launch(size={size}) but torchrun started WORLD_SIZE={world} ranks; make them agree")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = resolve_backend(backend, local_world)
    group = init_group(rank, size, local_rank, backend, "env://", timeout_s, startup_timeout_s)
    try:
        results = group.all_gather_object(fn(group, *args))
    except CollectiveError:
        shutdown(after_collective_failure=True)
        raise
    except BaseException:
        shutdown(after_collective_failure=False)
        raise
    shutdown(after_collective_failure=False)
    return results
