"""Every collective of `Group` against a single-process reference, on gloo with real spawned ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

from dist_rank_fns import assert_every_collective_right, run_every_collective
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
    assert_every_collective_right(results, size)
    # Group.collectives (experiments/calibrate prices the waits): counts 1, gather 1 (an all-empty one waits on none),
    # reduce x3, reduce-scatter 1, all-to-all 2 + 1 (counts known), broadcast_object 2, all_gather_object 2, barrier 1
    counted = {r["collectives"] for r in results}
    assert counted == ({0} if size == 1 else {14}), counted
