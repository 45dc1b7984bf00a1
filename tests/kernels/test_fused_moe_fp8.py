"""The fp8 (w8a8, per-tensor scales) fused MoE: the Triton path against its torch twin (on CPU with float16 storage
standing in for fp8, which the interpreter cannot multiply; on CUDA with fp8 itself), and the twin's fp8 scheme
against the bf16-free oracle."""

import pytest
import torch

from kernels.fused_moe import fused_moe_reference
from kernels.fused_moe_fp8 import (FP8, QUANT_MAX, fused_moe_fp8_torch, fused_moe_fp8_triton, quantize_per_tensor,
                                   quantize_weights)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 32 along K: an 8-bit MMA's K (the down GEMM's K = I = 16 then runs the kernel's masked-K path)
SMALL = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 2, "num_warps": 4,
         "num_stages": 2}
# CPU: float32 activations, float16 storage (the interpreter's only dot besides fp32); CUDA: what the GPU runs
QUANT, ACT = (FP8, torch.bfloat16) if DEVICE == "cuda" else (torch.float16, torch.float32)


def make_moe(T, H, E, I, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    weights, ids = torch.randn(T, E, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return hidden, w13, w2, ids, weights


@pytest.mark.parametrize("expert_offset", [None, 2])
def test_triton_path_matches_twin(expert_offset):
    """Same quantized inputs, same scales: the kernel's per-slot scale folding against the twin's dequantized
    products (expert_offset=2: ids are global, this rank holds experts 2..5 of 8, the rest contribute zero)."""
    hidden, w13, w2, ids, weights = make_moe(7, 32, 8, 16, 2, seed=0)
    if expert_offset is not None:
        w13, w2 = w13[2:6], w2[2:6]
    (w13_q, s13), (w2_q, s2) = quantize_weights(w13.to(DEVICE), QUANT), quantize_weights(w2.to(DEVICE), QUANT)
    args = (hidden.to(DEVICE, ACT), w13_q, s13, w2_q, s2, ids.to(DEVICE), weights.to(DEVICE))
    got = fused_moe_fp8_triton(*args, config=SMALL, expert_offset=expert_offset)
    expected = fused_moe_fp8_torch(*args, expert_offset=expert_offset)
    assert got.shape == hidden.shape and got.dtype == ACT
    assert expected.abs().amax() > 0.1
    if ACT == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    else:   # a GEMM output one bf16 ulp off can quantize one e4m3 step (6%) apart: bounded, and rare on average
        torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=0)
        assert (got.float() - expected.float()).abs().mean() < 1e-2


def test_fp8_tiles_need_32_along_k():
    hidden, w13, w2, ids, weights = make_moe(3, 32, 4, 16, 2, seed=2)
    (w13_q, s13), (w2_q, s2) = quantize_weights(w13), quantize_weights(w2)
    with pytest.raises(ValueError, match="BLOCK_SIZE_K >= 32"):
        fused_moe_fp8_triton(hidden, w13_q, s13, w2_q, s2, ids, weights, config={**SMALL, "BLOCK_SIZE_K": 16})


def test_fp8_scheme_stays_near_the_unquantized_layer():
    """e4m3 keeps 3 mantissa bits: the layer's output moves by a few percent, not more (a wrong scale moves it by
    its whole size)."""
    hidden, w13, w2, ids, weights = make_moe(16, 64, 8, 32, 2, seed=1)
    (w13_q, s13), (w2_q, s2) = quantize_weights(w13), quantize_weights(w2)
    got = fused_moe_fp8_torch(hidden, w13_q, s13, w2_q, s2, ids, weights)
    exact = fused_moe_reference(hidden, w13, w2, ids, weights)
    assert (got - exact).norm() / exact.norm() < 0.12


def test_quantization_is_per_tensor_and_needs_no_host_read():
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :3] = torch.tensor([1e-4, -3e-5, 0.0])                  # e4m3 subnormals (below 2^-6 of the scale) and zero
    q, scale = quantize_per_tensor(x)
    assert q.dtype == FP8 and scale.shape == (1,)
    assert q.float().abs().max() == QUANT_MAX                       # the largest |x| lands on e4m3's largest value
    # round to nearest: half of 2^-3 relative for e4m3's normal values (|x| / scale >= 2^-6), half of its subnormal
    # step (2^-9) below them, where a relative bound alone fails on a draw near zero
    normal = x.abs() >= scale * 2**-6
    assert not normal[0, :3].any()                                # the subnormal branch is checked too
    bound = torch.where(normal, x.abs() * 2**-4, scale * 2**-10)
    assert ((q.float() * scale - x).abs() <= bound * (1 + 1e-6)).all()
    meta_q, meta_scale = quantize_per_tensor(torch.empty(5, 40, device="meta"))   # data-dependent ops would fail
    assert meta_q.shape == (5, 40) and meta_scale.shape == (1,)
    w_q, w_scale = quantize_weights(torch.randn(3, 4, 6))
    assert w_scale.shape == (3,) and torch.equal(w_q.float().abs().flatten(1).amax(1), torch.full((3,), QUANT_MAX))
