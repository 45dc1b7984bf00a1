"""Every collective of `Group` against a single-process reference, on gloo with real spawned ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

from dist_rank_fns import COUNTS, SEND_MATRIX, WIDTH, rank_inputs, run_every_collective
from framework.dist import Group, launch


def test_size_one_group_is_the_identity_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    group = Group()
    x = torch.randn(3, 2)
    assert group.all_gather_counts(3) == [3]
    assert group.all_gather_uneven(x, [3]) is x
    assert group.all_reduce(x, op="max") is x
    assert group.reduce_scatter_uneven(x, [3]) is x
    received, recv_counts = group.all_to_all_uneven(x, [3])
    assert received is x and recv_counts == [3]
    assert group.broadcast_object({"a": 1}) == {"a": 1}
    assert group.all_gather_object("o") == ["o"]
    group.barrier()
    assert not torch.distributed.is_initialized()


def test_bad_arguments_name_what_is_allowed():
    group = Group()
    with pytest.raises(ValueError, match=r"one of \['max', 'min', 'sum'\], got 'avg'"):
        group.all_reduce(torch.ones(1), op="avg")
    with pytest.raises(ValueError, match=r"one non-negative int per rank \(size 1\), got \[1, 2\]"):
        group.all_gather_uneven(torch.ones(1, 2), [1, 2])
    with pytest.raises(ValueError, match=r"expected a tensor with 2 rows on this rank, got shape \(3, 2\)"):
        group.all_gather_uneven(torch.ones(3, 2), [2])
    with pytest.raises(ValueError, match="needs a process group"):
        Group(rank=0, size=2, backend="gloo")
    with pytest.raises(ValueError, match="backend must be 'auto', 'gloo' or 'nccl', got 'mpi'"):
        launch(run_every_collective, 2, backend="mpi")


def _reference(size: int) -> list[dict]:
    """What each rank must get, computed in one process from every rank's inputs."""
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


# Size 1 goes through the default start method (spawn: every rank imports torch, seconds on a busy machine); the
# others through the forkserver, which imported torch once for the whole test session.
@pytest.mark.parametrize("size, start_method", [(1, "spawn"), (2, "forkserver"), (4, "forkserver")])
def test_every_collective_matches_the_single_process_reference(size, start_method, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # the oversubscription warning must fire exactly once at size 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = launch(run_every_collective, size, backend="gloo", timeout_s=20, start_method=start_method)
    oversubscribed = [w for w in caught if "ranks on 2 CPU cores" in str(w.message)]
    assert len(oversubscribed) == (1 if size > 2 else 0)
    for rank, (got, want) in enumerate(zip(results, _reference(size))):
        for key, expected in want.items():
            if isinstance(expected, torch.Tensor):
                assert got[key].shape == expected.shape, (rank, key)
                # sums across ranks may be added in another order than torch's: allow float rounding only
                torch.testing.assert_close(got[key], expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {key}")
            else:
                assert got[key] == expected, (rank, key)
        assert got["gathered_all_empty"].shape == (0, WIDTH)
        assert all(got[f"reduce_{op}_in_place"] for op in ("sum", "min", "max"))
