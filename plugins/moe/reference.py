"""moe=reference: a plain torch loop over every expert on every rank. The numerical oracle for the others."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.model.reference import experts_reference
from framework.contracts.moe import MoEBackend, MoEConfig
from framework.core.registry import MOE


@dataclass
class ReferenceConfig(MoEConfig):
    name: str = "reference"


@MOE.register("reference")
class ReferenceMoE(MoEBackend):
    """Holds all experts whole and computes all of its tokens: no collective, output complete."""

    Config = ReferenceConfig
    token_layout = "all"
    partial = False

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        super().__init__(cfg, w13, w2, group)
        self.w13, self.w2 = w13, w2

    def forward(self, hidden, topk_ids, topk_weights):
        return experts_reference(hidden, self.w13, self.w2, topk_ids, topk_weights)
