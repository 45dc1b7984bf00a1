"""The fused MoE with fp8 (e4m3) weights and activations, w8a8 with per-tensor scales, as SGLang v0.4 ran
fp8 checkpoints (DeepSeek-V2/V3 FP8): each expert's weights carry one scale, and each GEMM's input is quantized on the
fly with one dynamic scale (max |x| / 448) before the GEMM. The grouped GEMM is kernels/fused_moe.py's, unchanged:
it multiplies each slot's output row by a per-slot factor (the router weight in the bf16 path), so the fp8 path
passes ``activation scale x the slot's expert's weight scale`` (x the router weight for the down GEMM) as that factor.

    fused_moe_fp8_triton(hidden[T, H] bf16, w13_q[E, 2I, H] fp8, w13_scale[E], w2_q[E, H, I] fp8, w2_scale[E],
                         topk_ids[T, k], topk_weights[T, k], *, config=None, device_name="cpu") -> [T, H]

``quantize_weights`` makes (w_q, scale) from bf16 weights. ``quant_dtype`` (default float8_e4m3fn) may be float16
for the interpreter, which cannot run fp8 dots: the scales and the folding are the same, only the storage differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused_moe import _check_inputs, _grouped_gemm, silu_and_mul, to_local_expert_ids
from kernels.moe_align import moe_align_block_size
from kernels.tuning import get_config, validate_config

FP8 = torch.float8_e4m3fn
QUANT_MAX = 448.0     # e4m3's largest finite value: scales map each tensor's max |x| onto it


def quantize_per_tensor(x: torch.Tensor, quant_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale as quant_dtype, scale [1] fp32), scale = max |x| / 448: one dynamic scale, computed on the device
    (no host sync: capturable). These are the kernels an fp8 GEMM adds before it (amax, scale, cast)."""
    scale = (x.abs().amax().float() / QUANT_MAX).clamp(min=1e-12).reshape(1)
    return (x.float() / scale).clamp(-QUANT_MAX, QUANT_MAX).to(quant_dtype), scale


def quantize_weights(w: torch.Tensor, quant_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert scales of ``w[E, ...]``: (w_q, scale [E] fp32)."""
    scale = (w.abs().flatten(1).amax(1).float() / QUANT_MAX).clamp(min=1e-12)
    view = scale.view(-1, *([1] * (w.dim() - 1)))
    return (w.float() / view).clamp(-QUANT_MAX, QUANT_MAX).to(quant_dtype), scale


def expert_gemms_fp8(
    hidden: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    slot_experts: torch.Tensor, weights: torch.Tensor, aligned: tuple, top_k: int, config: dict, out: torch.Tensor,
) -> torch.Tensor:
    """Quantize the input, gate/up GEMM (bf16 out), SiLU-and-mul, quantize, down GEMM into ``out [T*k, H]`` with the
    router weight. ``slot_experts [T*k]``: each slot's local expert (-1: not on this rank), ``weights [T*k]``: the
    router weights in fp32, ``aligned``: moe_align_block_size's output with ``config["BLOCK_SIZE_M"]``."""
    quant_dtype = w13_q.dtype
    if quant_dtype == FP8 and config["BLOCK_SIZE_K"] < 32:
        raise ValueError(f"fp8 dots need BLOCK_SIZE_K >= 32 (the 8-bit MMA's K), got {config['BLOCK_SIZE_K']}")
    expert = slot_experts.clamp(min=0)              # slots of other ranks' experts are never read
    a_q, a_scale = quantize_per_tensor(hidden, quant_dtype)
    # zeros, not empty: rows of slots no local expert owns are never written, and the activation scale's max runs
    # over every row (silu(0) * 0 = 0 leaves it alone; uninitialised memory would not)
    gate_up = hidden.new_zeros((out.shape[0], w13_q.shape[1]))
    _grouped_gemm(a_q, w13_q, gate_up, a_scale * w13_scale[expert], aligned, top_k, True, config)
    act_q, act_scale = quantize_per_tensor(silu_and_mul(gate_up), quant_dtype)
    _grouped_gemm(act_q, w2_q, out, act_scale * w2_scale[expert] * weights, aligned, 1, True, config)
    return out


def fused_moe_fp8_triton(
    hidden: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, config: dict | None = None,
    expert_offset: int | None = None, device_name: str = "cpu",
) -> torch.Tensor:
    """The MoE layer (module docstring); no host sync. ``config`` None: ``get_config(E, I, device_name, T)``, the
    bf16 tables (vLLM keeps separate fp8 files; none are shipped here)."""
    T, H, E, I, top_k = _check_inputs(hidden, w13_q, w2_q, topk_ids, topk_weights)
    if T == 0:
        return hidden.new_empty((0, H))
    if w13_q.dtype != w2_q.dtype or tuple(w13_scale.shape) != (E,) or tuple(w2_scale.shape) != (E,):
        raise ValueError(f"w13_q and w2_q must share a quantized dtype and carry one scale per expert ([{E}]), got "
                         f"{w13_q.dtype}/{w2_q.dtype}, scales {tuple(w13_scale.shape)}/{tuple(w2_scale.shape)}")
    config = validate_config(config if config is not None else get_config(E, I, device_name, T))
    local_ids = to_local_expert_ids(topk_ids, expert_offset, E)
    aligned = moe_align_block_size(local_ids, config["BLOCK_SIZE_M"], E)
    out_slots = hidden.new_zeros((T * top_k, H))
    weights = topk_weights.reshape(-1).to(torch.float32)
    expert_gemms_fp8(hidden, w13_q, w13_scale, w2_q, w2_scale, local_ids.reshape(-1), weights, aligned, top_k,
                     config, out_slots)
    return out_slots.view(T, top_k, H).sum(dim=1)


def fused_moe_fp8_torch(
    hidden: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, expert_offset: int | None = None, **_: object,
) -> torch.Tensor:
    """The torch twin and oracle of the quantization scheme: the same dynamic activation quantization, products of
    the dequantized values in fp32 (the GEMM outputs rounded to hidden's dtype where the kernel stores them)."""
    T, H, E, I, top_k = _check_inputs(hidden, w13_q, w2_q, topk_ids, topk_weights)
    local_ids = to_local_expert_ids(topk_ids, expert_offset, E)
    a_q, a_scale = quantize_per_tensor(hidden, w13_q.dtype)
    x = a_q.float() * a_scale
    slots = [(t, j) for t in range(T) for j in range(top_k) if local_ids[t, j] >= 0]
    gate_up = torch.zeros((T * top_k, 2 * I), dtype=hidden.dtype, device=hidden.device)
    for t, j in slots:
        e = int(local_ids[t, j])
        gate_up[t * top_k + j] = (x[t] @ (w13_q[e].float() * w13_scale[e]).t()).to(hidden.dtype)
    gate, up = gate_up.float().split(I, dim=-1)
    act_q, act_scale = quantize_per_tensor((F.silu(gate) * up).to(hidden.dtype), w13_q.dtype)
    act = act_q.float() * act_scale
    out = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
    for t, j in slots:
        e = int(local_ids[t, j])
        row = act[t * top_k + j] @ (w2_q[e].float() * w2_scale[e]).t()
        out[t] += (row * topk_weights[t, j].float()).to(hidden.dtype).float()
    return out.to(hidden.dtype)
