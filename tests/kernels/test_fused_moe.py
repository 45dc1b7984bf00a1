"""fused_moe_triton (interpreted on CPU, compiled on CUDA: these small edge cases run on the GPU when there is one)
and fused_moe_torch against fused_moe_reference."""

import logging

import pytest
import torch

import kernels
from kernels.fused_moe import fused_moe_reference, fused_moe_torch, fused_moe_triton

IMPLEMENTATIONS = {"triton": fused_moe_triton, "torch": fused_moe_torch}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
         "num_stages": 2}


def make_moe(T, H, E, I, top_k, seed, dtype=torch.float32, device=DEVICE):
    """Random layer inputs scaled so the output is O(1); top-k ids are distinct per token, as a router gives."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    logits = torch.randn(T, E, generator=gen)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    to = dict(device=device)
    return (hidden.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            topk_ids.to(**to), topk_weights.to(**to))


def assert_matches_reference(impl, hidden, w13, w2, topk_ids, topk_weights, atol=1e-4, **kwargs):
    expected = fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights, **kwargs)
    got = IMPLEMENTATIONS[impl](hidden, w13, w2, topk_ids, topk_weights, **kwargs)
    assert got.shape == expected.shape == hidden.shape and got.dtype == hidden.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)
    return got


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "T, H, E, I, top_k, seed",
    [
        (13, 32, 4, 24, 2, 0),  # I not a multiple of the tile: ragged N in GEMM 1, ragged K in GEMM 2
        (9, 40, 6, 16, 3, 1),  # ragged H
        (7, 32, 4, 16, 1, 2),  # top_k = 1
        (3, 16, 8, 16, 2, 3),  # fewer slots than a block; most experts get nothing
        (40, 48, 3, 20, 2, 4),  # several blocks per expert
    ],
)
def test_matches_reference(impl, T, H, E, I, top_k, seed):
    assert_matches_reference(impl, *make_moe(T, H, E, I, top_k, seed), config=SMALL)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_default_config_and_grouped_tiles(impl):
    args = make_moe(20, 72, 4, 40, 2, seed=5)
    assert_matches_reference(impl, *args)  # config=None -> default for device "cpu"
    grouped = dict(SMALL, GROUP_SIZE_M=4, BLOCK_SIZE_N=32)
    assert_matches_reference(impl, *args, config=grouped)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_expert_with_no_tokens(impl):
    hidden, w13, w2, topk_ids, topk_weights = make_moe(12, 32, 5, 16, 2, seed=6)
    topk_ids = torch.where(topk_ids == 3, torch.full_like(topk_ids, 4), topk_ids)
    topk_ids[:, 1] = torch.where(topk_ids[:, 0] == topk_ids[:, 1], (topk_ids[:, 1] + 1) % 3, topk_ids[:, 1])
    assert not (topk_ids == 3).any()
    assert_matches_reference(impl, hidden, w13, w2, topk_ids, topk_weights, config=SMALL)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_all_tokens_on_one_expert(impl):
    hidden, w13, w2, _, topk_weights = make_moe(18, 32, 4, 16, 1, seed=7)
    topk_ids = torch.full((18, 1), 2, device=DEVICE)
    got = assert_matches_reference(impl, hidden, w13, w2, topk_ids, topk_weights, config=SMALL)
    # independent check: with one expert the layer is that expert's MLP scaled by the weight
    gate, up = (hidden @ w13[2].t()).chunk(2, dim=-1)
    dense = (torch.nn.functional.silu(gate) * up) @ w2[2].t() * topk_weights
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_without_router_weight(impl):
    args = make_moe(11, 32, 4, 16, 2, seed=8)
    unweighted = assert_matches_reference(impl, *args, config=SMALL, apply_router_weight=False)
    weighted = IMPLEMENTATIONS[impl](*args, config=SMALL)
    assert not torch.allclose(unweighted, weighted, atol=1e-3)


@pytest.mark.parametrize("impl", [*IMPLEMENTATIONS, "reference"])
def test_zero_tokens(impl):
    hidden, w13, w2, topk_ids, topk_weights = make_moe(0, 32, 4, 16, 2, seed=9)
    fn = IMPLEMENTATIONS.get(impl, fused_moe_reference)
    out = fn(hidden, w13, w2, topk_ids, topk_weights, config=SMALL)
    assert out.shape == (0, 32) and out.dtype == hidden.dtype


# The interpreter warns when SiLU-and-mul meets the never-written (and never read) rows of non-local slots.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_local_experts_sum_to_the_full_layer(impl):
    """Expert parallelism: two ranks hold experts [0, 3) and [3, 6); their outputs add up to the full layer."""
    hidden, w13, w2, topk_ids, topk_weights = make_moe(14, 32, 6, 16, 2, seed=10)
    full = fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights)
    fn = IMPLEMENTATIONS[impl]
    total_remapped = torch.zeros_like(full)
    total_offset = torch.zeros_like(full)
    for start in (0, 3):
        local_w13, local_w2 = w13[start:start + 3], w2[start:start + 3]
        is_local = (topk_ids >= start) & (topk_ids < start + 3)
        local_ids = torch.where(is_local, topk_ids - start, -1)
        total_remapped += fn(hidden, local_w13, local_w2, local_ids, topk_weights, config=SMALL)
        total_offset += fn(hidden, local_w13, local_w2, topk_ids, topk_weights, config=SMALL, expert_offset=start)
    torch.testing.assert_close(total_remapped, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(total_offset, full, atol=1e-4, rtol=0)
    # a rank none of whose experts were picked returns zeros
    nobody = torch.full_like(topk_ids, -1)
    assert torch.equal(fn(hidden, w13[:3], w2[:3], nobody, topk_weights, config=SMALL), torch.zeros_like(full))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_intermediate_slices_sum_to_the_full_layer(impl):
    """Tensor-parallel MoE: each rank holds I/2 of every expert; the partial outputs add up to the full layer."""
    hidden, w13, w2, topk_ids, topk_weights = make_moe(10, 32, 4, 32, 2, seed=11)
    full = fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights)
    I, half = 32, 16
    total = torch.zeros_like(full)
    for sl in (slice(0, half), slice(half, I)):
        w13_part = torch.cat([w13[:, :I][:, sl], w13[:, I:][:, sl]], dim=1)
        total += IMPLEMENTATIONS[impl](hidden, w13_part, w2[:, :, sl], topk_ids, topk_weights, config=SMALL)
    torch.testing.assert_close(total, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_non_contiguous_hidden(impl):
    hidden, w13, w2, topk_ids, topk_weights = make_moe(9, 32, 4, 16, 2, seed=12)
    wide = torch.zeros(9, 64, device=DEVICE)
    wide[:, ::2] = hidden
    assert_matches_reference(impl, wide[:, ::2], w13, w2, topk_ids, topk_weights, config=SMALL)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: {**a, "w2": a["w2"][:, :, :8]}, r"w2 must be \[E=4, H=32, I=16\]"),
        (lambda a: {**a, "w13": a["w13"][:, :31]}, r"w13 must be \[E, 2I, H=32\]"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights shape"),
        (lambda a: {**a, "topk_ids": a["topk_ids"] + 4}, r"\[0, 4\) or be -1"),
    ],
)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_input_is_named(impl, mutate, message):
    names = ("hidden", "w13", "w2", "topk_ids", "topk_weights")
    args = mutate(dict(zip(names, make_moe(5, 32, 4, 16, 2, seed=13))))
    with pytest.raises(ValueError, match=message):
        IMPLEMENTATIONS[impl](*(args[n] for n in names), config=SMALL, check=True)


def test_float16_output_dtype():
    args = make_moe(10, 32, 4, 16, 2, seed=14, dtype=torch.float16)
    for impl in IMPLEMENTATIONS:
        assert_matches_reference(impl, *args, atol=1e-2, config=SMALL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="only the interpreter lacks bfloat16 tl.dot")
def test_interpreter_refuses_bfloat16():
    args = make_moe(4, 32, 4, 16, 2, seed=15, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not bfloat16"):
        fused_moe_triton(*args, config=SMALL)
    assert_matches_reference("torch", *args, atol=1e-2)  # the twin handles bfloat16 on CPU


def test_select_fused_moe_falls_back_once(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_warned_no_gpu", False)
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert kernels.select_fused_moe("cpu") is fused_moe_torch
        assert kernels.select_fused_moe(torch.device("cpu")) is fused_moe_torch
    assert [r.getMessage() for r in caplog.records] == ["fused_moe: no GPU, using the torch twin"]
    assert kernels.select_fused_moe("cuda") is fused_moe_triton



@pytest.mark.long
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real in every test")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter never runs Triton's compiler: compile for sm_90 (ptxas ships with Triton) in a process
    without TRITON_INTERPRET, and check the GEMMs' loads are software-pipelined (cp.async into shared memory), which
    decode-sized batches need to stream weights at full bandwidth."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hopper_compile.py"))], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout)
    assert {c["name"] for c in compiled} == {"decode_bf16", "prefill_bf16", "fp32_ieee", "silu_and_mul_bf16"}
    for c in compiled:
        assert (c["cp_async"] > 0) == (c["name"] != "silu_and_mul_bf16"), c
