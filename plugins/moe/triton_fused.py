"""moe=triton_fused: every rank holds every expert, sliced along the intermediate dim across the instance's ranks,
and runs one fused grouped GEMM per projection (kernels/fused_moe.py); the parallelism plugin sums the slices.

This is SGLang's default MoE under tensor parallelism: no token moves, each rank does 1/size of every expert's
FLOPs and reads 1/size of its weights, and the price is a reduction of the full [T, H] output per layer.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from framework.contracts.moe import MoEBackend, routed_expert_bytes
from kernels import fused_moe_for
from framework.core.registry import MOE


class Kernel(enum.StrEnum):
    """The fused MoE implementation a backend runs (`moe.kernel`, kernels.fused_moe_for)."""
    auto = "auto"       # Triton on CUDA, the torch twin on a CPU
    triton = "triton"
    torch = "torch"     # the torch twin, also on a GPU


@dataclass
class TritonFusedConfig:
    name: str = "triton_fused"
    kernel: Kernel = Kernel.auto


def slice_intermediate(w13: torch.Tensor, w2: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, ...]:
    """This rank's 1/size of every expert's intermediate dim. Gate and up rows are sliced separately: slicing the
    concatenated [2I] rows would hand rank 0 all the gates and rank 1 all the ups."""
    inter = w2.shape[-1]
    if inter % size:
        raise ValueError(f"moe=triton_fused slices moe_intermediate_size={inter} across parallel.size={size} "
                         f"ranks, which does not divide it; pick a size that divides {inter}")
    if size == 1:
        return w13, w2
    part = inter // size
    lo, hi = rank * part, (rank + 1) * part
    w13_local = torch.cat([w13[:, lo:hi], w13[:, inter + lo:inter + hi]], dim=1).contiguous()
    return w13_local, w2[:, :, lo:hi].contiguous()


@MOE.register("triton_fused")
class TritonFusedMoE(MoEBackend):
    """All experts on every rank, intermediate dim split; layout "all", a partial sum when size > 1."""

    Config = TritonFusedConfig
    token_layout = "all"
    partial = True            # on more than one rank (MoEBackend.layout)
    fused_moe_call = True

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, size: int) -> int:
        return routed_expert_bytes(model_cfg, intermediate=model_cfg.moe_intermediate_size // size)

    @classmethod
    def expert_split(cls, cfg, size: int) -> tuple[int, int]:
        return 1, size

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        super().__init__(cfg, w13, w2, group)
        self.w13, self.w2 = slice_intermediate(w13, w2, group.rank, group.size)
        self.fused_moe, self.device_name = fused_moe_for(cfg.kernel, w13.device)

    def forward(self, hidden, topk_ids, topk_weights):
        # No collective here: the reduction of the partial sums is the parallelism plugin's (layout contract).
        return self.fused_moe(hidden, self.w13, self.w2, topk_ids, topk_weights, device_name=self.device_name)
