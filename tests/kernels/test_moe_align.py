"""moe_align_block_size: a hand-checked example, the invariants on random inputs, and no host sync (meta tensors)."""

import pytest
import torch

from kernels.moe_align import max_padded_slots, moe_align_block_size


def align(topk_ids: torch.Tensor, block_size: int, num_experts: int, **kwargs):
    """moe_align_block_size's outputs cut at the padded end (which the kernel reads from the device)."""
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, block_size, num_experts, **kwargs)
    worst = max_padded_slots(topk_ids.numel(), block_size, num_experts)
    assert sorted_ids.shape == (worst,) and expert_ids.shape == (worst // block_size,) and worst % block_size == 0
    assert post_padded.shape == (1,) and post_padded.dtype == torch.int32
    total = int(post_padded)
    assert (sorted_ids[total:] == topk_ids.numel()).all(), "past the padded end: only the sentinel"
    assert (expert_ids[total // block_size:] == -1).all(), "blocks past the padded end have no expert"
    return sorted_ids[:total], expert_ids[:total // block_size], total


def check_invariants(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    sorted_ids, expert_ids, total = align(topk_ids, block_size, num_experts)
    flat = topk_ids.reshape(-1)
    sentinel = flat.numel()
    assert total == sorted_ids.numel() and total % block_size == 0
    assert expert_ids.numel() == total // block_size

    real = sorted_ids[sorted_ids != sentinel].long()
    expected_slots = torch.nonzero(flat >= 0).squeeze(1)
    # every real slot exactly once (slots of non-local experts, id -1, nowhere)
    assert torch.equal(real.sort().values, expected_slots)
    assert ((sorted_ids >= 0) & (sorted_ids <= sentinel)).all()

    blocks = sorted_ids.view(-1, block_size).long()
    for block, expert in zip(blocks, expert_ids.tolist()):
        slots = block[block != sentinel]
        assert slots.numel() > 0, "a block holds only padding"
        assert (flat[slots] == expert).all(), "a block mixes experts"
        # padding only at the end of the block, and slots of one expert keep token order
        n = slots.numel()
        assert (block[n:] == sentinel).all()
        assert (slots.diff() > 0).all()
    assert (expert_ids.diff() >= 0).all(), "experts appear in ascending order"
    # each expert uses the fewest blocks that hold its slots
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    blocks_per_expert = torch.bincount(expert_ids.long(), minlength=num_experts)
    assert torch.equal(blocks_per_expert, (counts + block_size - 1) // block_size)
    return sorted_ids, expert_ids, total


def test_hand_checked_example():
    topk_ids = torch.tensor([[2, 0], [0, 3], [2, 0]])  # slots 0..5 -> experts 2,0,0,3,2,0
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, block_size=4, num_experts=4)
    pad = 6
    # worst case: 6 slots + 4 experts x 3 padding = 18 -> 20 rows (5 blocks); this routing uses 12
    assert sorted_ids.tolist() == [1, 2, 5, pad, 0, 4, pad, pad, 3, pad, pad, pad] + [pad] * 8
    assert expert_ids.tolist() == [0, 2, 3, -1, -1]
    assert post_padded.tolist() == [12]
    assert sorted_ids.dtype == expert_ids.dtype == torch.int32


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_invariants(seed, block_size):
    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 50, (1,), generator=gen))
    num_experts = int(torch.randint(1, 10, (1,), generator=gen))
    top_k = int(torch.randint(1, num_experts + 1, (1,), generator=gen))
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(T)])
    check_invariants(topk_ids, block_size, num_experts)


def test_non_local_slots_are_left_out():
    gen = torch.Generator().manual_seed(7)
    topk_ids = torch.randint(-1, 3, (20, 2), generator=gen)
    check_invariants(topk_ids, 4, 3)
    sorted_ids, expert_ids, total = align(torch.full((5, 2), -1), 4, 3)
    assert total == 0 and sorted_ids.numel() == 0 and expert_ids.numel() == 0


def test_experts_without_tokens_and_all_on_one_expert():
    topk_ids = torch.full((10, 1), 5)
    sorted_ids, expert_ids, total = check_invariants(topk_ids, 4, 8)
    assert expert_ids.tolist() == [5, 5, 5] and total == 12


def test_zero_tokens():
    sorted_ids, expert_ids, total = align(torch.empty((0, 2), dtype=torch.long), 16, 4)
    assert total == 0 and sorted_ids.numel() == 0 and expert_ids.numel() == 0


@pytest.mark.parametrize("num_slots, block_size, num_experts, worst", [
    (6, 16, 64, 96),       # decode, 1 token, top 6: at most 6 experts, one block each
    (12, 4, 4, 24),        # 12 + 4 experts x 3 = 24
    (5, 4, 2, 12),         # 5 + 2 x 3 = 11 -> 12 (whole blocks)
    (0, 16, 8, 0),
])
def test_worst_case_length(num_slots, block_size, num_experts, worst):
    assert max_padded_slots(num_slots, block_size, num_experts) == worst


def test_worst_case_is_reached():
    """Every expert gets one slot: each one block, so the padded end is the worst case itself."""
    topk_ids = torch.arange(8).view(4, 2)
    _, _, total = check_invariants(topk_ids, 4, 8)
    assert total == max_padded_slots(8, 4, 8) == 32


def test_no_value_is_read_on_the_host():
    """Meta tensors carry shapes but no values: any op whose output size depends on the data (nonzero, bincount,
    .item(), boolean masks) fails on them, exactly the ops that sync with the host and break CUDA-graph capture."""
    topk_ids = torch.empty((1, 6), dtype=torch.long, device="meta")   # a decode step of one token, top 6
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, 16, 64)
    assert sorted_ids.shape == (96,) and expert_ids.shape == (6,) and post_padded.shape == (1,)
    with pytest.raises((RuntimeError, NotImplementedError)):   # the check reads the ids: it is the one sync
        moe_align_block_size(topk_ids, 16, 64, check=True)


@pytest.mark.parametrize(
    "topk_ids, block_size, num_experts, message",
    [
        (torch.tensor([[0, 4]]), 4, 4, r"\[0, 4\) or be -1"),
        (torch.tensor([[0, -2]]), 4, 4, r"\[0, 4\) or be -1"),
        (torch.tensor([0, 1]), 4, 4, r"\[T, top_k\]"),
        (torch.tensor([[0.0]]), 4, 4, "integer"),
        (torch.tensor([[0]]), 0, 4, "block_size"),
    ],
)
def test_bad_input_is_named(topk_ids, block_size, num_experts, message):
    with pytest.raises(ValueError, match=message):
        moe_align_block_size(topk_ids, block_size, num_experts, check=True)
