"""What only the MoE tests need from a model (kept out of framework/: no run resets expert counts)."""
from __future__ import annotations


def reset_expert_load(model) -> None:
    """Zero every MoE layer's expert counts."""
    for layer in model.moe_layers():
        layer.expert_counts.zero_()
