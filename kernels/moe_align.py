"""Data prep for the fused MoE kernel: group the token slots by expert, padded to whole blocks.

Same contract as vLLM's / SGLang's ``moe_align_block_size``, written as a few vectorised torch ops (no loop over
tokens) that never read a device value back to the host: every output has a size fixed by the input's shape (the
worst case), and the padded length stays on the device. So the GPU path can be captured into a CUDA graph and replayed
with other routings. A "slot" is one (token, choice) pair, numbered ``t * top_k + j`` in the flattened ``topk_ids``.
"""

from __future__ import annotations

import torch


def max_padded_slots(num_slots: int, block_size: int, num_experts: int) -> int:
    """The longest ``sorted_token_ids`` any routing of ``num_slots`` slots can need, rounded up to whole blocks: each
    expert that gets a slot adds at most ``block_size - 1`` padding, and at most ``min(num_experts, num_slots)``
    experts get one. (vLLM bounds it by ``num_slots + num_experts * (block_size - 1)``; the min keeps a decode
    step's grid to the blocks it can use.)"""
    worst = num_slots + min(num_experts, num_slots) * (block_size - 1)
    return -(-worst // block_size) * block_size


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise unless every id lies in ``[0, num_experts)`` or is -1. Reads the min and max back to the host: a sync,
    so it runs only when a caller asks (``check=True``), never on the serving path, whose ids come from the router."""
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= num_experts):
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}) or be -1 (slot of a non-local expert); "
            f"got min {int(topk_ids.min())}, max {int(topk_ids.max())}"
        )


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, check: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the token slots by expert and pad every expert's group to a multiple of ``block_size``.

    Args:
        topk_ids: ``[T, top_k]`` integer expert ids in ``[0, num_experts)``. ``-1`` marks a slot that belongs to
            no local expert (expert parallelism: the expert lives on another rank); such slots are left out.
        block_size: rows per block; must equal the kernel's ``BLOCK_SIZE_M``.
        num_experts: number of (local) experts.
        check: validate the ids first (a host sync; see ``check_expert_ids``). Out-of-range ids are otherwise
            undefined behaviour, as in vLLM.

    Returns (P = ``max_padded_slots(T * top_k, block_size, num_experts)``, the worst case):
        sorted_token_ids: ``int32 [P]``, slot indices grouped by expert in ascending expert order (stable: slots of
            one expert keep their original order); each group is padded with the sentinel ``T * top_k``, and so is
            everything past the padded end.
        expert_ids: ``int32 [P // block_size]``, the expert of each block (every block holds one expert only;
            experts with no slots get no block); -1 for blocks past the padded end.
        num_tokens_post_padded: ``int32 [1]`` on the device: the padded length actually used, a multiple of
            ``block_size``. The kernel loads it and its blocks past that end return at once.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if check:
        check_expert_ids(topk_ids, num_experts)

    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    max_padded = max_padded_slots(num_slots, block_size, num_experts)

    # Slots of non-local experts (-1) count as a virtual expert E, sorted after the real ones and never placed.
    key = torch.where(flat >= 0, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))   # bincount, minus its host read of the largest id
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_counts[num_experts:].zero_()   # not `[E] = 0`: on CUDA that copies a host scalar (a sync)
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    num_tokens_post_padded = padded_ends[num_experts:].to(torch.int32)

    # Stable sort keeps each expert's slots in token order; a slot's rank inside its expert's group is its position
    # in the sorted list minus the number of slots of all smaller experts.
    sorted_keys, order = torch.sort(key, stable=True)
    unpadded_starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(num_slots, device=device) - unpadded_starts[sorted_keys]
    # Non-local slots go to a trash row past the end, cut off below.
    dest = torch.where(sorted_keys < num_experts, padded_starts[sorted_keys] + rank_in_expert, max_padded)
    sorted_token_ids = torch.full((max_padded + 1,), num_slots, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))

    # Block b belongs to the expert whose padded range holds row b * block_size: the number of padded ends <= it.
    block_starts = torch.arange(0, max_padded, block_size, device=device)
    expert_ids = torch.searchsorted(padded_ends[:num_experts], block_starts, right=True)
    expert_ids = torch.where(block_starts < num_tokens_post_padded.long(), expert_ids, -1).to(torch.int32)
    return sorted_token_ids[:max_padded], expert_ids, num_tokens_post_padded
