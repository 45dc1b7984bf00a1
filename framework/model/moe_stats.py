"""Expert-load statistics: how many routed token slots each expert of each MoE layer got, and how uneven that is.

Every `MoE` layer counts the top-k slots its router assigns (`MoE.expert_counts`, a device tensor updated without a
host sync). This module turns the counts into results keys: the raw material for load-balancing research (which
experts run hot, how far a rank of expert parallelism waits on the busiest one).

Imbalance is max / mean of the per-expert (or per-rank) counts: 1.0 is perfectly even, num_experts means every slot
went to one expert; 0.0 when nothing was routed yet.
"""
from __future__ import annotations

from typing import Any

import torch

from framework.model.layers import MoE


def _moe_layers(model) -> list[tuple[int, MoE]]:
    return [(i, block.ffn) for i, block in enumerate(model.layers) if isinstance(block.ffn, MoE)]


def rank_expert_counts(model) -> tuple[dict[int, list[int]], bool]:
    """This rank's counts per MoE layer, and whether they are a share to be summed over the instance's ranks
    (token layout "local") rather than the whole instance's (layout "all")."""
    layers = _moe_layers(model)
    local = any(layer.backend is not None and layer.backend.token_layout == "local" for _, layer in layers)
    return {i: layer.expert_counts.cpu().tolist() for i, layer in layers}, local


def combine_rank_counts(per_rank: list[tuple[dict[int, list[int]], bool]]) -> dict[int, list[int]]:
    """The instance's counts from every rank's `rank_expert_counts` (no collective: the parent combines)."""
    first, local = per_rank[0]
    if not local:
        return first
    return {i: [sum(c[i][e] for c, _ in per_rank) for e in range(len(first[i]))] for i in first}


def instance_expert_counts(model, group=None) -> dict[int, list[int]]:
    """Transformer layer index -> slots per expert for the whole engine instance.

    With a backend of token layout "all" every rank routes every token of the step, so its own counts are the
    instance's; with layout "local" each rank routes only its share and the counts are summed across `group`.
    A collective then: with a multi-rank `group`, call this on every rank.
    """
    layers = _moe_layers(model)
    if not layers:
        return {}
    counts = torch.stack([layer.expert_counts for _, layer in layers]).clone()
    local = any(layer.backend is not None and layer.backend.token_layout == "local" for _, layer in layers)
    if group is not None and group.size > 1 and local:
        counts = group.all_reduce(counts.to(group.device))
    return {i: row.tolist() for (i, _), row in zip(layers, counts.cpu())}


def _imbalance(counts: list[int]) -> float:
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def expert_load_stats(model, group=None) -> dict[str, Any]:
    """Results keys. Flat, per MoE layer i: `moe_layer{i}_routed_slots`, `moe_layer{i}_max_expert_slots`,
    `moe_layer{i}_expert_imbalance` (max/mean over experts) and, on a multi-rank instance whose expert count divides
    by its size, `moe_layer{i}_ep_rank_imbalance` (max/mean over the ranks that would own contiguous blocks of
    experts under moe=ep); over all layers `expert_imbalance_max` and `expert_imbalance_mean`. Nested:
    `expert_load` = {"layer{i}": slots per expert}. A collective when `group` has several ranks (see
    instance_expert_counts)."""
    return {**load_stats(instance_expert_counts(model, group), 1 if group is None else group.size),
            **placement_stats(model)}


PLACEMENT_KEYS = ("eplb_rebalances", "eplb_experts_moved", "eplb_bytes_moved", "eplb_stall_s")   # stall: mode=sim


def placement_stats(model) -> dict[str, int]:
    """The cost of re-placing experts (moe=ep with moe.eplb), summed over the MoE layers: rebalances, experts a rank
    received, their bytes, for the whole instance (every rank derives the same moves). Empty for a backend that
    places nothing."""
    out: dict[str, int] = {}
    for _, layer in _moe_layers(model):
        stats = getattr(layer.backend, "stats", {})
        for key in PLACEMENT_KEYS:
            if key in stats:
                out[key] = out.get(key, 0) + int(stats[key])
    return out


def load_stats(per_layer: dict[int, list[int]], size: int = 1) -> dict[str, Any]:
    """The results keys of `expert_load_stats` from an instance's counts on `size` ranks."""
    out: dict[str, Any] = {}
    for i, counts in per_layer.items():
        out[f"moe_layer{i}_routed_slots"] = sum(counts)
        out[f"moe_layer{i}_max_expert_slots"] = max(counts)
        out[f"moe_layer{i}_expert_imbalance"] = _imbalance(counts)
        if size > 1 and len(counts) % size == 0:
            per_rank = len(counts) // size
            out[f"moe_layer{i}_ep_rank_imbalance"] = _imbalance(
                [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(size)])
    imbalances = [_imbalance(c) for c in per_layer.values()]
    if imbalances:
        out["expert_imbalance_max"] = max(imbalances)
        out["expert_imbalance_mean"] = sum(imbalances) / len(imbalances)
    out["expert_load"] = {f"layer{i}": counts for i, counts in per_layer.items()}
    return out
