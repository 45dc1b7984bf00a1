"""framework.dist on NCCL: a size-1 group on one GPU (process-group set-up and the timed wait on NCCL work), and,
with two GPUs, every collective of `Group` against the single-process reference and a skipped collective's timeout.
Skipped without enough GPUs (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from dist_rank_fns import assert_every_collective_right, nccl_size_one, run_every_collective, skip_a_collective
from framework.dist import RankFailed, launch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL with 2 ranks needs 2 GPUs, {GPUS} visible")


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_size_one_nccl_group():
    (result,) = launch(nccl_size_one, 1, backend="nccl", timeout_s=60)
    assert (result["backend"], result["device"]) == ("nccl", "cuda:0")
    for name, out in result["outputs"].items():   # one rank: every collective hands its input back
        assert torch.equal(out, result["input"]), name


@two_gpus
def test_every_collective_on_nccl():
    assert_every_collective_right(launch(run_every_collective, 2, backend="nccl", timeout_s=60), 2)


@two_gpus
def test_a_skipped_collective_times_out_on_nccl():
    with pytest.raises(RankFailed) as info:
        launch(skip_a_collective, 2, 3.0, backend="nccl", timeout_s=3.0)
    assert info.value.rank == 1 and info.value.exc_type == "CollectiveTimeout"
    assert info.value.exc_message.startswith("rank 1: all_gather_uneven timed out after 3.0 s at step 7")
