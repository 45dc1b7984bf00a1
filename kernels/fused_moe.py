"""Fused MoE for SiLU-gated experts: a Triton grouped GEMM over expert-sorted token slots, its torch twin, and the
plain loop it is checked against.

Every entry point computes, for tokens t and their top-k choices j (expert e = topk_ids[t, j]):

    out[t] = sum_j  w_tj * W2[e] @ (silu(W1[e] @ x_t) * (W3[e] @ x_t))        (w_tj = 1 when apply_router_weight=False)

Weight layout (vLLM's): ``w13[E, 2I, H]`` holds gate (W1, rows [:I]) then up (W3, rows [I:]); ``w2[E, H, I]``.
Shapes come from the weights, so a rank may hold:
  * a slice of the intermediate dim (tensor-parallel MoE): ``w13 = cat(W1[:, sl], W3[:, sl])``, ``w2 = W2[:, :, sl]``
    (slice gate and up separately, not the concatenated tensor); the result is this rank's partial sum, to be
    all-reduced by the caller;
  * only its local experts (expert parallelism): E = number of local experts, and topk_ids either already in local
    numbering with -1 for slots whose expert lives elsewhere, or global with ``expert_offset`` = the global id of
    local expert 0 (ids outside [expert_offset, expert_offset + E) then count as -1). Such slots contribute zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.moe_align import check_expert_ids, moe_align_block_size
from kernels.tuning import get_config, validate_config


@triton.jit
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, EM, num_valid_slots,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, FP32_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """C[slot, :] = A[slot // TOP_K, :] @ B[expert(slot)].T (* topk_weight[slot]) for every slot in the sorted list.

    A: [rows, K]; B: [E, N, K]; C: [num_valid_slots, N]; sorted_token_ids [EM], expert_ids and the 1-element
    num_tokens_post_padded from moe_align_block_size with block_size == BLOCK_SIZE_M (each M-block is one expert).
    The grid covers the worst case EM; blocks past the padded end return at once, so no size is read on the host.
    Sentinel slots (>= num_valid_slots) are masked out.
    """
    # Grouped ordering: GROUP_SIZE_M consecutive M-blocks sweep the N-blocks together so B tiles stay in L2.
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return

    offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_SIZE_K):
        if EVEN_K:   # no mask along K: the weight loads stay full-width vectors
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        acc = acc * weight[:, None]

    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, I, stride_xm, stride_om, BLOCK: tl.constexpr):
    """out[row, :] = silu(x[row, :I]) * x[row, I:2I], in fp32, rounded once (SGLang's silu_and_mul)."""
    row = tl.program_id(axis=0).to(tl.int64)
    offs = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + I + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def to_local_expert_ids(topk_ids: torch.Tensor, expert_offset: int | None, num_local_experts: int) -> torch.Tensor:
    """Global -> local expert ids: ``id - expert_offset``, and -1 where that falls outside [0, num_local_experts).
    ``expert_offset=None`` means the ids are local already and are returned unchanged."""
    if expert_offset is None:
        return topk_ids
    local = topk_ids.long() - expert_offset
    return torch.where((local >= 0) & (local < num_local_experts) & (topk_ids >= 0), local, -1)


def _check_inputs(hidden, w13, w2, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    """Validate shapes; return (T, H, E, I, top_k)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    T, H = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H={H}] (gate rows then up rows), got shape {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must be [E={E}, H={H}, I={I}] to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, top_k], got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
                         f"{tuple(topk_ids.shape)}")
    devices = {t.device for t in (hidden, w13, w2, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return T, H, E, I, topk_ids.shape[1]


def _grouped_gemm(a, b, c, weights, aligned, top_k, mul_weight, config) -> None:
    """Launch fused_moe_kernel: c[slot] = a[slot // top_k] @ b[expert].T (* weight[slot]); the grid is sized from
    the worst-case padded length (a shape), never from the routing."""
    sorted_ids, expert_ids, num_tokens_post_padded = aligned
    N, K, EM = b.shape[1], b.shape[2], sorted_ids.shape[0]
    grid = (triton.cdiv(EM, config["BLOCK_SIZE_M"]) * triton.cdiv(N, config["BLOCK_SIZE_N"]),)
    fused_moe_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_tokens_post_padded,
        N, K, EM, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        BLOCK_SIZE_M=config["BLOCK_SIZE_M"], BLOCK_SIZE_N=config["BLOCK_SIZE_N"], BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config["GROUP_SIZE_M"], TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_weight,
        FP32_IEEE=a.dtype == torch.float32, EVEN_K=K % config["BLOCK_SIZE_K"] == 0,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` in one launch."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    block = min(1024, triton.next_power_of_2(inter))
    silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                           BLOCK=block)
    return out


def expert_gemms(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, config: dict, apply_router_weight: bool,
    out: torch.Tensor,
) -> torch.Tensor:
    """The launches that read expert weights: gate/up GEMM into ``[T*k, 2I]``, SiLU-and-mul, down GEMM into
    ``out [T*k, H]`` (router weight applied there; rows of slots that no local expert owns are left as they were).
    ``weights``: the router weights flattened to fp32 ``[T*k]``; ``aligned``: moe_align_block_size's output with
    ``config["BLOCK_SIZE_M"]``. Benchmarks time this alone, with routing and alignment done once beforehand."""
    gate_up = hidden.new_empty((out.shape[0], w13.shape[1]))
    _grouped_gemm(hidden, w13, gate_up, weights, aligned, top_k, False, config)
    _grouped_gemm(silu_and_mul(gate_up), w2, out, weights, aligned, 1, apply_router_weight, config)
    return out


def fused_moe_triton(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, config: dict | None = None, apply_router_weight: bool = True, expert_offset: int | None = None,
    device_name: str = "cpu", check: bool = False,
) -> torch.Tensor:
    """The MoE layer (module docstring): moe_align_block_size, then ``expert_gemms``, then the sum over the k slots.
    No device value is read on the host (``check=True`` adds a range check of the ids, which does), so on a GPU the
    call can be captured into a CUDA graph.

    config: launch settings (see kernels.tuning); None -> ``get_config(E, I, device_name, T, dtype)``, where
    device_name is the caller's ``torch.cuda.get_device_name()``. Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1
    was set before this module was imported. Returns ``[T, H]`` in hidden's dtype; T=0 launches nothing.
    """
    T, H, E, I, top_k = _check_inputs(hidden, w13, w2, topk_ids, topk_weights)
    if T == 0:
        return hidden.new_empty((0, H))
    interpreted = isinstance(fused_moe_kernel, InterpretedFunction)
    if hidden.device.type != "cuda" and not interpreted:
        raise RuntimeError(f"fused_moe_triton got {hidden.device} tensors but Triton runs them only on CUDA; set "
                           "TRITON_INTERPRET=1 before importing kernels.fused_moe, or call fused_moe_torch")
    if interpreted and hidden.dtype == torch.bfloat16:
        # The interpreter multiplies bf16's raw bit patterns in tl.dot (triton-lang/triton#11584, unsupported).
        raise ValueError("fused_moe_triton under TRITON_INTERPRET supports float32 and float16, not bfloat16; "
                         "cast to float32 or call fused_moe_torch")
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"hidden, w13, w2 must share a dtype, got {hidden.dtype}, {w13.dtype}, {w2.dtype}")
    if config is None:
        config = get_config(E, I, device_name, T, dtype="float32" if hidden.dtype == torch.float32 else None)
    config = validate_config(config)

    local_ids = to_local_expert_ids(topk_ids, expert_offset, E)
    aligned = moe_align_block_size(local_ids, config["BLOCK_SIZE_M"], E, check=check)
    out_slots = hidden.new_zeros((T * top_k, H))  # zeros: slots of non-local experts are never written
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    expert_gemms(hidden, w13, w2, weights, aligned, top_k, config, apply_router_weight, out_slots)
    return out_slots.view(T, top_k, H).sum(dim=1)


def fused_moe_torch(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, config: dict | None = None, apply_router_weight: bool = True, expert_offset: int | None = None,
    device_name: str = "cpu", check: bool = False,
) -> torch.Tensor:
    """The torch twin of fused_moe_triton (same signature; config, device_name and check are accepted and unused:
    it always checks the ids): slots grouped by expert, two matmuls per non-empty expert, results index_add'ed into
    an fp32 ``[T, H]``. It sizes its per-expert matmuls on the host, so it syncs (the check, the per-expert counts):
    the CPU path, where a sync costs nothing."""
    T, H, E, I, top_k = _check_inputs(hidden, w13, w2, topk_ids, topk_weights)
    if T == 0:
        return hidden.new_empty((0, H))
    flat_ids = to_local_expert_ids(topk_ids, expert_offset, E).reshape(-1).long()
    check_expert_ids(flat_ids, E)
    valid_slots = torch.nonzero(flat_ids >= 0).squeeze(1)
    experts = flat_ids[valid_slots]
    slots_by_expert = valid_slots[torch.argsort(experts, stable=True)]
    counts = torch.bincount(experts, minlength=E).tolist()
    weights = topk_weights.reshape(-1).float()

    out = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
    for expert, slots in enumerate(torch.split(slots_by_expert, counts)):
        if slots.numel() == 0:
            continue
        tokens = slots // top_k
        gate, up = (hidden[tokens] @ w13[expert].t()).split(I, dim=-1)
        y = ((F.silu(gate) * up) @ w2[expert].t()).float()
        if apply_router_weight:
            y = y * weights[slots, None]
        out.index_add_(0, tokens, y)
    return out.to(hidden.dtype)


def fused_moe_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, config: dict | None = None, apply_router_weight: bool = True, expert_offset: int | None = None,
    device_name: str = "cpu", check: bool = False,
) -> torch.Tensor:
    """The oracle: for every expert and every choice column, run the expert on the tokens that picked it, in fp32.
    (config, device_name and check are accepted for the shared signature and unused.)"""
    T, H, E, I, top_k = _check_inputs(hidden, w13, w2, topk_ids, topk_weights)
    local_ids = to_local_expert_ids(topk_ids, expert_offset, E)
    x = hidden.float()
    out = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
    for expert in range(E):
        w_gate, w_up = w13[expert, :I].float(), w13[expert, I:].float()
        w_down = w2[expert].float()
        for j in range(top_k):
            rows = local_ids[:, j] == expert
            if not rows.any():
                continue
            y = (F.silu(x[rows] @ w_gate.t()) * (x[rows] @ w_up.t())) @ w_down.t()
            if apply_router_weight:
                y = y * topk_weights[rows, j].float()[:, None]
            out[rows] += y
    return out.to(hidden.dtype)
