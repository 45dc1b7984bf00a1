"""moe_align_block_size: a hand-checked example plus the invariants on random inputs."""

import pytest
import torch

from kernels.moe_align import moe_align_block_size


def check_invariants(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block_size, num_experts)
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
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block_size=4, num_experts=4)
    pad = 6
    assert sorted_ids.tolist() == [1, 2, 5, pad, 0, 4, pad, pad, 3, pad, pad, pad]
    assert expert_ids.tolist() == [0, 2, 3]
    assert total == 12
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
    sorted_ids, expert_ids, total = moe_align_block_size(torch.full((5, 2), -1), 4, 3)
    assert total == 0 and sorted_ids.numel() == 0 and expert_ids.numel() == 0


def test_experts_without_tokens_and_all_on_one_expert():
    topk_ids = torch.full((10, 1), 5)
    sorted_ids, expert_ids, total = check_invariants(topk_ids, 4, 8)
    assert expert_ids.tolist() == [5, 5, 5] and total == 12


def test_zero_tokens():
    sorted_ids, expert_ids, total = moe_align_block_size(torch.empty((0, 2), dtype=torch.long), 16, 4)
    assert total == 0 and sorted_ids.numel() == 0 and expert_ids.numel() == 0


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
        moe_align_block_size(topk_ids, block_size, num_experts)
