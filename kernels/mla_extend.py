"""MLA extend (prefill) attention in the weight-absorbed form, as SGLang v0.4's Triton backend ran it for DeepSeek
models whenever a batch had to take the absorbed path (v0.4 runs a whole extend batch absorbed once any request in it
has a cached or earlier-chunk prefix). Written here from that design (triton_ops/extend_attention.py), not copied.

Each new token's query ``q [kv_lora_rank + rope]`` (W_UK folded in) attends to its request's cached prefix (rows of
the latent cache, read through the page table) and, causally, to the request's new tokens (their latent rows, not yet
in the cache); the value is a row's first ``kv_lora_rank`` columns. ``mla_extend_kernel`` runs one program per
(request, head, block of BLOCK_M new tokens), like SGLang's extend kernel: the prefix pass first, then the new tokens
up to the block's last query, one online softmax across both. Each head's program reads the rows again (the kernel
has no head grouping), so the latent is loaded heads x (query blocks) times; L2 serves most repeats.

Entry points: ``fn(q[T, H, D], new_latent[T, D] (or [T, 1, D]), kv_cache[S, D], page_table[B, >= max prefix],
prefix_lens[B], extend_lens[B], sm_scale, v_dim=512) -> out[T, H, v_dim]``; request b's new tokens are rows
``sum(extend_lens[:b]) ..`` of q, new_latent and out. D = v_dim + rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.mla_decode import attend_rows

# SGLang v0.4's tiles for a 576-wide head on sm80/sm90 (a wider head than 256 gets the small M block), one stage.
BLOCK_M, BLOCK_N = 32, 64
NUM_WARPS, NUM_STAGES = 8, 1


@triton.jit
def mla_extend_kernel(
    q_ptr, new_ptr, kv_ptr, page_table_ptr, prefix_lens_ptr, extend_lens_ptr, extend_starts_ptr, out_ptr,
    sm_scale, stride_qt, stride_qh, stride_new, stride_kv, stride_pt, stride_ot, stride_oh,
    V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Attention of one head's BLOCK_M new tokens of one request over its prefix, then causally over its new tokens."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + b)
    if m_block * BLOCK_M < extend_len:   # the grid covers the longest request's new tokens
        first = tl.load(extend_starts_ptr + b).to(tl.int64)
        prefix_len = tl.load(prefix_lens_ptr + b)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_v = tl.arange(0, BLOCK_V)
        offs_r = tl.arange(0, BLOCK_R)
        q_rows = q_ptr + (first + offs_m)[:, None] * stride_qt + h * stride_qh
        q_nope = tl.load(q_rows + offs_v[None, :], mask=m_mask[:, None] & (offs_v < V_DIM)[None, :], other=0.0)
        q_rope = tl.load(q_rows + V_DIM + offs_r[None, :], mask=m_mask[:, None] & (offs_r < ROPE_DIM)[None, :],
                         other=0.0)
        run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for n0 in range(0, prefix_len, BLOCK_N):          # the cached prefix: every query sees all of it
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < prefix_len
            rows = tl.load(page_table_ptr + b * stride_pt + offs_n, mask=n_mask, other=0).to(tl.int64)
            run_max, run_sum, acc = attend_rows(
                q_nope, q_rope, kv_ptr + rows[:, None] * stride_kv, n_mask, n_mask[None, :], run_max, run_sum, acc,
                sm_scale, V_DIM, ROPE_DIM, BLOCK_V, BLOCK_R, FP32_IEEE)
        causal_end = tl.minimum((m_block + 1) * BLOCK_M, extend_len)
        for n0 in range(0, causal_end, BLOCK_N):          # the new tokens: a query sees those up to itself
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < extend_len
            causal = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
            run_max, run_sum, acc = attend_rows(
                q_nope, q_rope, new_ptr + (first + offs_n)[:, None] * stride_new, n_mask, causal, run_max, run_sum,
                acc, sm_scale, V_DIM, ROPE_DIM, BLOCK_V, BLOCK_R, FP32_IEEE)
        out = out_ptr + (first + offs_m)[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        tl.store(out, (acc / run_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (offs_v < V_DIM)[None, :])


def _check(q, new_latent, kv_cache, page_table, prefix_lens, extend_lens, v_dim):
    """Validate shapes; return (new latent as [T, D], cache as [S, D])."""
    def two_d(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1) if x.dim() == 3 and x.shape[1] == 1 else x
    new, kv = two_d(new_latent), two_d(kv_cache)
    if q.dim() != 3 or new.dim() != 2 or tuple(new.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"q must be [T, H, D] and new_latent [T, D] (or [T, 1, D]), got {tuple(q.shape)} and "
                         f"{tuple(new_latent.shape)}")
    if kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"kv_cache must be [S, D={q.shape[2]}] or [S, 1, D], got {tuple(kv_cache.shape)}")
    if not 0 < v_dim < q.shape[2]:
        raise ValueError(f"v_dim={v_dim} must be in (0, D={q.shape[2]})")
    B = extend_lens.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != B or tuple(prefix_lens.shape) != (B,):
        raise ValueError(f"page_table must be [B={B}, max_prefix] and prefix_lens [B], got "
                         f"{tuple(page_table.shape)} and {tuple(prefix_lens.shape)}")
    if q.stride(2) != 1 or new.stride(1) != 1 or kv.stride(1) != 1:
        raise ValueError("q, new_latent and kv_cache need unit stride along D")
    return new, kv


def mla_extend_triton(
    q: torch.Tensor, new_latent: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float, *, v_dim: int = 512,
    max_extend_len: int | None = None, block_m: int = BLOCK_M, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """The extend kernel (module docstring): ``[T, H, v_dim]`` in q's dtype. ``max_extend_len`` sizes the grid;
    None reads it from extend_lens (a host sync; pass it to capture into a CUDA graph). CUDA tensors, or CPU ones
    under TRITON_INTERPRET=1 (float32 and float16 there: the interpreter's bf16 tl.dot is wrong)."""
    new, kv = _check(q, new_latent, kv_cache, page_table, prefix_lens, extend_lens, v_dim)
    interpreted = isinstance(mla_extend_kernel, InterpretedFunction)
    if q.device.type != "cuda" and not interpreted:
        raise RuntimeError("mla_extend_triton runs on CUDA, or on the CPU with TRITON_INTERPRET=1 set before "
                           "kernels.mla_extend is imported; mla_extend_torch is the CPU path")
    if interpreted and q.dtype == torch.bfloat16:
        raise ValueError("mla_extend_triton under TRITON_INTERPRET supports float32 and float16, not bfloat16")
    T, H, D = q.shape
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    starts = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens.to(torch.int32)
    out = q.new_empty((T, H, v_dim))
    rope_dim = D - v_dim
    mla_extend_kernel[(extend_lens.shape[0], H, triton.cdiv(max_extend_len, block_m))](
        q, new, kv, page_table, prefix_lens, extend_lens, starts, out, sm_scale,
        q.stride(0), q.stride(1), new.stride(0), kv.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
        V_DIM=v_dim, ROPE_DIM=rope_dim, BLOCK_V=triton.next_power_of_2(v_dim),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        FP32_IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def mla_extend_torch(
    q: torch.Tensor, new_latent: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float, *, v_dim: int = 512, **_: object,
) -> torch.Tensor:
    """The torch twin and oracle: per request, softmax attention in fp32 over [prefix rows, new rows] with a causal
    mask on the new ones (launch settings are accepted and unused)."""
    new, kv = _check(q, new_latent, kv_cache, page_table, prefix_lens, extend_lens, v_dim)
    out = q.new_empty((q.shape[0], q.shape[1], v_dim))
    first = 0
    for b, (n, p) in enumerate(zip(extend_lens.tolist(), prefix_lens.tolist())):
        rows = torch.cat([kv[page_table[b, :p].long()], new[first:first + n]]).float()          # [p + n, D]
        scores = torch.einsum("thd,kd->htk", q[first:first + n].float(), rows) * sm_scale
        visible = torch.arange(p + n, device=q.device)[None, :] <= p + torch.arange(n, device=q.device)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:first + n] = torch.einsum("htk,kv->thv", probs, rows[:, :v_dim]).to(q.dtype)
        first += n
    return out


def mla_extend_traffic(prompts: int, heads: int, extend_len: int, prefix_len: int = 0, *, v_dim: int = 512,
                       rope_dim: int = 64, itemsize: int = 2, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> dict:
    """FLOPs and bytes of one call of ``prompts`` requests, each ``extend_len`` new tokens after ``prefix_len``
    cached ones. flops: 2 (v_dim + rope_dim) per score plus 2 v_dim per value, per (head, query, visible key).
    bytes: the rows each program loads (every head re-reads them; a query block reads the prefix and the new rows
    up to its end), q and out; ``once_bytes``: the latent and the new rows read once, q and out (what the roofline
    cost model charges today)."""
    width = v_dim + rope_dim
    visible = extend_len * prefix_len + extend_len * (extend_len + 1) / 2          # (query, key) pairs per head
    blocks = -(-extend_len // block_m)
    new_rows = (min(-(-min((i + 1) * block_m, extend_len) // block_n) * block_n, extend_len) for i in range(blocks))
    rows_loaded = sum(prefix_len + n for n in new_rows)
    q_out = prompts * heads * extend_len * (width + v_dim) * itemsize
    return {"flops": 2.0 * prompts * heads * visible * (width + v_dim),
            "bytes": prompts * heads * rows_loaded * width * itemsize + q_out,
            "once_bytes": prompts * (prefix_len + extend_len) * width * itemsize + q_out}
