"""The MoE backend interface: what a `moe=` plugin implements (plugins/moe/)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class MoEConfig:
    name: str = "reference"


class MoEBackend(ABC):
    """Computes the routed-expert output of one MoE layer.

    `token_layout` says what the backend takes: "all" (every rank of the instance holds every token of the step, the
    parallelism plugin gathers them under DP attention) or "local" (each rank passes only its own tokens; the backend
    moves them itself, e.g. all-to-all). `partial` says whether the output is a partial sum that the parallelism
    plugin must reduce across ranks. Shared experts are not the backend's business (the model adds them).
    """

    Config = MoEConfig
    token_layout: str = "all"
    partial: bool = False

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        """w13: [E, 2*I, H] (gate rows then up rows), w2: [E, H, I]: the full expert weights of the layer;
        the backend keeps the part its rank owns."""
        self.cfg, self.group = cfg, group

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] in `token_layout`, topk_ids/topk_weights [T, k] -> routed output [T, H]."""
