"""Data prep for the fused MoE kernel: group the token slots by expert, padded to whole blocks.

Same contract as vLLM's / SGLang's ``moe_align_block_size``, written as a few vectorised torch ops (no loop over
tokens). A "slot" is one (token, choice) pair, numbered ``t * top_k + j`` in the flattened ``topk_ids``.
"""

from __future__ import annotations

import torch


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort the token slots by expert and pad every expert's group to a multiple of ``block_size``.

    Args:
        topk_ids: ``[T, top_k]`` integer expert ids in ``[0, num_experts)``. ``-1`` marks a slot that belongs to
            no local expert (expert parallelism: the expert lives on another rank); such slots are left out.
        block_size: rows per block; must equal the kernel's ``BLOCK_SIZE_M``.
        num_experts: number of (local) experts.

    Returns:
        sorted_token_ids: ``int32 [P]``, slot indices grouped by expert in ascending expert order (stable: slots of
            one expert keep their original order); each group is padded with the sentinel ``T * top_k``.
        expert_ids: ``int32 [P // block_size]``, the expert of each block (every block holds one expert only;
            experts with no slots get no block).
        num_tokens_post_padded: ``P``, the total padded length, a multiple of ``block_size``. vLLM returns it as a
            1-element tensor because its ``sorted_token_ids`` is over-allocated; here the array is exact, so a
            Python int.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")

    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    if num_slots and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}) or be -1 (slot of a non-local expert); "
            f"got min {int(flat.min())}, max {int(flat.max())}"
        )

    valid_slots = torch.nonzero(flat >= 0).squeeze(1)
    valid_experts = flat[valid_slots]
    counts = torch.bincount(valid_experts, minlength=num_experts)
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    total = int(padded_counts.sum())

    # Stable sort keeps each expert's slots in token order; a slot's rank inside its expert's group is its position
    # in the sorted list minus the number of slots of all smaller experts.
    order = torch.argsort(valid_experts, stable=True)
    sorted_experts = valid_experts[order]
    unpadded_starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=device) - unpadded_starts[sorted_experts]

    sorted_token_ids = torch.full((total,), num_slots, dtype=torch.int32, device=device)
    sorted_token_ids[padded_starts[sorted_experts] + rank_in_expert] = valid_slots[order].to(torch.int32)
    expert_ids = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=device), padded_counts // block_size
    )
    return sorted_token_ids, expert_ids, total
