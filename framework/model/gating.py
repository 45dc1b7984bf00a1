"""DeepSeek expert selection, shared by the model and every MoE backend (and the reference)."""
from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, *, top_k: int, n_group: int, topk_group: int, gating: str,
                   routed_scaling_factor: float, norm_topk_prob: bool,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (topk_ids int64 [T, k], topk_weights fp32 [T, k]).

    v2 (DeepSeek-V2): softmax scores; groups ranked by their best expert; weights = the chosen scores.
    v3 (DeepSeek-V3): sigmoid scores; a correction bias steers selection only; groups ranked by the sum of
    their top-2 biased scores; weights come from the unbiased scores.
    """
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    if gating == "v2":
        scores = logits.softmax(dim=-1)
        choice = scores
    elif gating == "v3":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
    else:
        raise ValueError(f"unknown gating {gating!r}; known: v2, v3")
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.max(dim=-1).values if gating == "v2" else grouped.topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        expert_mask = group_mask.repeat_interleave(num_experts // n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * routed_scaling_factor
