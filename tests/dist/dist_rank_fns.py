"""Functions that run inside spawned ranks (module level, so spawned processes can import them by name).

`rank_inputs` builds each rank's inputs deterministically, so the test process can rebuild every rank's inputs and
compute the single-process reference for each collective.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from framework.dist import CollectiveTimeout, Group

# Per-size token counts with zeros on some ranks; send_matrix[i][j] = rows rank i sends to rank j.
COUNTS = {1: [3], 2: [0, 3], 4: [3, 0, 2, 1]}
SEND_MATRIX = {
    1: [[2]],
    2: [[0, 2], [3, 0]],
    4: [[1, 0, 2, 0], [0, 0, 0, 0], [2, 1, 0, 3], [0, 4, 1, 1]],
}
WIDTH = 3


def rank_inputs(rank: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * size + rank)
    counts, sends = COUNTS[size], SEND_MATRIX[size]
    return {
        "own_rows": torch.randn(counts[rank], WIDTH, generator=gen),
        "reduce_in": torch.randn(4, 2, generator=gen),
        "scatter_in": torch.randn(sum(counts), WIDTH, generator=gen),
        "a2a_in": torch.randn(sum(sends[rank]), WIDTH, generator=gen),
    }


def run_every_collective(group: Group) -> dict:
    """Call each collective once (results go back to the test process, which checks them against a reference)."""
    torch.set_num_threads(1)
    rank, size = group.rank, group.size
    inp = rank_inputs(rank, size)
    counts = group.all_gather_counts(COUNTS[size][rank])
    out = {"counts": counts, "gathered": group.all_gather_uneven(inp["own_rows"], counts)}
    out["gathered_all_empty"] = group.all_gather_uneven(torch.empty(0, WIDTH), [0] * size)
    for op in ("sum", "min", "max"):
        x = inp["reduce_in"].clone()
        returned = group.all_reduce(x, op=op)
        out[f"reduce_{op}"] = x
        out[f"reduce_{op}_in_place"] = returned is x
    out["scattered"] = group.reduce_scatter_uneven(inp["scatter_in"], counts)
    received, recv_counts = group.all_to_all_uneven(inp["a2a_in"], SEND_MATRIX[size][rank])
    out["a2a"], out["a2a_recv_counts"] = received, recv_counts
    # The return trip of an expert-parallel dispatch: counts known, so no count exchange.
    back, _ = group.all_to_all_uneven(received, recv_counts, recv_counts=SEND_MATRIX[size][rank])
    out["a2a_round_trip"] = back
    out["broadcast"] = group.broadcast_object({"from": rank, "payload": list(range(rank + 2))}, src=size - 1)
    out["gathered_objects"] = group.all_gather_object(("rank", rank, "x" * rank))
    group.barrier()
    return out


def skip_a_collective(group: Group, timeout_s: float) -> str:
    """Rank 0 skips the step's all_gather_uneven (but stays alive); rank 1 must time out naming itself."""
    group.step = 7
    if group.rank == 0:
        time.sleep(timeout_s + 3.0)  # alive but absent; the launcher stops it once rank 1 fails
        return "rank 0 skipped"
    start = time.monotonic()
    try:
        group.all_gather_uneven(torch.ones(1, 2), [1, 1])
    except CollectiveTimeout as exc:
        exc.add_note(f"elapsed_s={time.monotonic() - start:.3f}")
        raise
    return "rank 1 was not expected to get here"


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def raise_on_rank_1(group: Group, pid_dir: str) -> None:
    _write_pid(pid_dir, group.rank)
    group.barrier()
    if group.rank == 1:
        raise ValueError("bad token id 42 on rank 1")
    group.barrier()  # rank 0 waits here until the launcher stops it


def sigkill_rank_1(group: Group, pid_dir: str) -> None:
    _write_pid(pid_dir, group.rank)
    group.barrier()
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    group.barrier()


def sleep_forever(group: Group, pid_dir: str) -> None:
    _write_pid(pid_dir, group.rank)
    group.barrier()
    time.sleep(600)


def echo_server(group: Group, channel, scale: int) -> int:
    """Rank 0 serves requests from the parent; every request is a collective step over all ranks.

    Request: an int n -> reply: sum over ranks of (n * scale + rank). None -> stop. "exit" -> rank 1 exits abruptly.
    """
    served = 0
    while True:
        request = channel.recv() if group.rank == 0 else None
        request = group.broadcast_object(request, src=0)
        if request is None:
            return served
        if request == "exit":
            if group.rank == 1:
                os._exit(3)
            group.barrier()  # fails on rank 0 once rank 1 is gone
        total = group.all_reduce(torch.tensor([request * scale + group.rank]), op="sum")
        served += 1
        if group.rank == 0:
            channel.send({"request": request, "total": int(total.item())})
