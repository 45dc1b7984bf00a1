"""A multi-rank instance under torchrun (one process per rank, possibly on several nodes, NCCL on GPUs).

There is no parent process to spawn ranks: every torchrun process is one rank. Rank 0 runs its rank loop
(framework.instance.rank_loop) in a thread and the bench / verify driver in its main thread; the two talk through a
pipe with the launch channel's interface, so `InstanceClient` drives this exactly as it drives spawned ranks. The
other ranks run the rank loop in their main thread and return once rank 0 says "stop". At the end every rank's
statistics are all-gathered to rank 0, as `RankProcesses.join` returns them.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any, Callable

from framework.dist.launch import STARTUP_TIMEOUT_S, Channel
from framework.dist.rank import init_group, resolve_backend, shutdown, torchrun_env
from framework.dist.group import CollectiveError
from framework.instance.local import ThreadRanks


def under_torchrun() -> bool:
    return torchrun_env() is not None


def join_group(spec, backend: str):
    rank, world, local_rank = torchrun_env()
    if world != spec.parallel.size:
        raise ValueError(f"parallel.size={spec.parallel.size} but torchrun started WORLD_SIZE={world} ranks; "
                         "make them agree")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = resolve_backend(backend, local_world)
    return init_group(rank, world, local_rank, backend, "env://", spec.parallel.timeout_s, STARTUP_TIMEOUT_S)


def serve_other_rank(group, fn: Callable[..., Any], spec) -> None:
    """Ranks > 0: serve until rank 0 stops the instance, hand the statistics to rank 0, leave the group."""
    failed = False
    try:
        group.all_gather_object(fn(group, None, spec))
    except CollectiveError:
        failed = True
        raise
    finally:
        shutdown(after_collective_failure=failed)


class TorchrunRanks(ThreadRanks):
    """Rank 0's stand-in for `framework.dist.RankProcesses`: its own rank loop in a thread."""

    _stuck = "rank 0's loop did not finish"

    def __init__(self, group, fn: Callable[..., Any], spec):
        self.group = group
        here, there = multiprocessing.Pipe(duplex=True)
        self._channel = Channel(here)
        self._thread = threading.Thread(target=self._run, args=(fn, spec, Channel(there)), name="rank0-loop",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn, spec, channel: Channel) -> None:
        try:
            self._results = self.group.all_gather_object(fn(self.group, channel, spec))
        except BaseException as e:                 # noqa: BLE001 - recv() raises it in the driver's thread
            self._error = e
        finally:
            channel.close()                        # the driver's recv sees EOF

    def send(self, obj: Any) -> None:
        self._channel.send(obj)

    def terminate(self) -> None:
        """Leave the process group (without waiting on peers after a failure); torchrun stops the other ranks."""
        if not self._thread.is_alive():
            shutdown(after_collective_failure=isinstance(self._error, CollectiveError))
        self._channel.close()
