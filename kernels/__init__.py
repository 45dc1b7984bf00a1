"""Pure kernels (no framework or plugin imports), each with a torch reference beside it. See kernels/README.md."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)
_warned_no_gpu = False
KERNELS = ("auto", "triton", "torch")      # moe.kernel


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


def fused_moe_for(kernel: str, device: torch.device | str) -> tuple[Callable[..., torch.Tensor], str]:
    """The fused MoE function a backend calls, and the device name that keys its launch configs.

    kernel: "auto" (Triton on CUDA, the torch twin elsewhere, logged once: select_fused_moe), "triton"
    (forced; on a CPU only under TRITON_INTERPRET=1, which tests use) or "torch" (the twin, also on a GPU).
    """
    device = torch.device(device)
    if kernel not in KERNELS:
        raise ValueError(f"moe.kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if kernel == "auto":
        return select_fused_moe(device), device_name
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import fused_moe as fm
    if kernel == "torch":
        return fm.fused_moe_torch, device_name
    if device.type != "cuda" and not isinstance(fm.fused_moe_kernel, InterpretedFunction):
        raise ValueError("moe.kernel=triton needs a CUDA device, or TRITON_INTERPRET=1 set before kernels.fused_moe "
                         "is imported (slow: for tests); use moe.kernel=auto or torch on a CPU")
    return fm.fused_moe_triton, device_name
