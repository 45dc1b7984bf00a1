"""Pure kernels (no framework or plugin imports), each with a torch reference beside it. See kernels/README.md."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)
_warned_no_gpu = False


def select_fused_moe(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The fused MoE for tensors on ``device``: the Triton kernel on CUDA, the torch twin elsewhere (logged once).

    Imported lazily so that importing ``kernels`` does not decorate the Triton kernel before a test or script has
    had the chance to set TRITON_INTERPRET.
    """
    global _warned_no_gpu
    from kernels.fused_moe import fused_moe_torch, fused_moe_triton

    if torch.device(device).type == "cuda":
        return fused_moe_triton
    if not _warned_no_gpu:
        logger.info("fused_moe: no GPU, using the torch twin")
        _warned_no_gpu = True
    return fused_moe_torch
