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


def expected_results(size: int) -> list[dict]:
    """What each rank of run_every_collective must get, computed in one process from every rank's inputs."""
    inputs = [rank_inputs(r, size) for r in range(size)]
    counts, sends = COUNTS[size], SEND_MATRIX[size]
    stacked = torch.stack([i["reduce_in"] for i in inputs])
    total = sum(i["scatter_in"] for i in inputs)
    offsets = [sum(counts[:r]) for r in range(size)]
    # Block (i -> j) of rank i's all-to-all input: rows after the blocks it sends to ranks < j.
    block = lambda i, j: inputs[i]["a2a_in"][sum(sends[i][:j]) : sum(sends[i][: j + 1])]  # noqa: E731
    refs = []
    for r in range(size):
        refs.append({
            "counts": counts,
            "gathered": torch.cat([i["own_rows"] for i in inputs]),
            "reduce_sum": stacked.sum(0), "reduce_min": stacked.min(0).values, "reduce_max": stacked.max(0).values,
            "scattered": total[offsets[r] : offsets[r] + counts[r]],
            "a2a": torch.cat([block(i, r) for i in range(size)]),
            "a2a_recv_counts": [sends[i][r] for i in range(size)],
            "a2a_round_trip": inputs[r]["a2a_in"],
            "broadcast": {"from": size - 1, "payload": list(range(size + 1))},
            "gathered_objects": [("rank", i, "x" * i) for i in range(size)],
        })
    return refs


def assert_every_collective_right(results: list[dict], size: int) -> None:
    """run_every_collective's per-rank results against expected_results."""
    for rank, (got, want) in enumerate(zip(results, expected_results(size), strict=True)):
        for key, expected in want.items():
            if isinstance(expected, torch.Tensor):
                assert got[key].shape == expected.shape, (rank, key)
                # sums across ranks may be added in another order than torch's: allow float rounding only
                torch.testing.assert_close(got[key], expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {key}")
            else:
                assert got[key] == expected, (rank, key)
        assert got["gathered_all_empty"].shape == (0, WIDTH)
        assert all(got[f"reduce_{op}_in_place"] for op in ("sum", "min", "max"))


def run_every_collective(group: Group) -> dict:
    """Call each collective once on the group's device (results go back to the test process on the CPU, which
    checks them against expected_results)."""
    torch.set_num_threads(1)
    rank, size = group.rank, group.size
    inp = {name: t.to(group.device) for name, t in rank_inputs(rank, size).items()}
    counts = group.all_gather_counts(COUNTS[size][rank])
    out = {"counts": counts, "gathered": group.all_gather_uneven(inp["own_rows"], counts)}
    out["gathered_all_empty"] = group.all_gather_uneven(torch.empty(0, WIDTH, device=group.device), [0] * size)
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
    out["collectives"] = group.collectives          # every wait counted: the same number on every rank
    return {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in out.items()}


def skip_a_collective(group: Group, timeout_s: float) -> str:
    """Rank 0 skips the step's all_gather_uneven (but stays alive); rank 1 must time out naming itself."""
    group.step = 7
    if group.rank == 0:
        time.sleep(timeout_s + 3.0)  # alive but absent; the launcher stops it once rank 1 fails
        return "rank 0 skipped"
    start = time.monotonic()
    try:
        group.all_gather_uneven(torch.ones(1, 2, device=group.device), [1, 1])
    except CollectiveTimeout as exc:
        exc.add_note(f"elapsed_s={time.monotonic() - start:.3f}")
        raise
    return "rank 1 was not expected to get here"


def nccl_size_one(group: Group) -> dict:
    """A size-1 NCCL group: Group's own methods skip torch.distributed at size 1, so call the process group's
    collectives directly, each waited on through the group's timed wait (on NCCL work objects)."""
    import torch.distributed as dist

    from framework.dist.group import all_gather_single, reduce_scatter_single

    x = torch.arange(6.0, device=group.device).view(3, 2)
    outs = {name: torch.full_like(x, -1.0) for name in ("all_gather", "reduce_scatter", "all_to_all")}
    outs["all_reduce"], outs["broadcast"] = x.clone(), x.clone()
    calls = {
        "all_reduce": lambda: dist.all_reduce(outs["all_reduce"], group=group.pg, async_op=True),
        "all_gather": lambda: all_gather_single(outs["all_gather"], x, group=group.pg, async_op=True),
        "reduce_scatter": lambda: reduce_scatter_single(outs["reduce_scatter"], x, group=group.pg, async_op=True),
        "all_to_all": lambda: dist.all_to_all_single(outs["all_to_all"], x, output_split_sizes=[3],
                                                     input_split_sizes=[3], group=group.pg, async_op=True),
        "broadcast": lambda: dist.broadcast(outs["broadcast"], src=0, group=group.pg, async_op=True),
    }
    for name, call in calls.items():
        group._wait(call(), name)
    return {"backend": group.backend, "device": str(group.device), "input": x.cpu(),
            "outputs": {name: out.cpu() for name, out in outs.items()}}


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
