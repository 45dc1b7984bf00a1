"""MLA decode attention in the weight-absorbed form, as SGLang v0.4 ran it for DeepSeek models on its Triton backend
(written here from that design, not copied): a two-stage, split-KV ("flash-decoding") kernel with grouped heads.

Absorbed MLA has one KV head: each cached token is one row of the latent cache, ``[kv_lora_rank | rope]`` (512 + 64
wide for DeepSeek-V2/V3), shared by every query head. A query head is ``q [kv_lora_rank + rope]`` (q_nope already
folded into latent space by W_UK); its score against a token is ``q . row``, and its output is the softmax-weighted
sum of the rows' first ``kv_lora_rank`` columns (the value; W_UV lifts it back to per-head width afterwards).

Stage 1 (``mla_decode_stage1_kernel``): one program per (request, block of BLOCK_H = 16 query heads, KV split). The
request's context is cut into ``num_kv_splits`` equal chunks; a program streams its chunk's rows once for all heads of
its block (the "grouped" kernel: 16 heads share one read of the latent, so a rank with h heads reads each row
ceil(h / 16) times), keeps an online softmax, and writes fp32 partial outputs ``[kv_lora_rank]`` and their
log-sum-exp per head and split. Stage 2 (``mla_decode_stage2_kernel``): one program per (request, head) merges the
splits' partial outputs by their log-sum-exps into the output, in q's dtype.

Entry points share one signature: ``fn(q[B, H, D], kv_cache[S, D] (or [S, 1, D]), page_table[B, >= max len] int32,
seq_lens[B], sm_scale, v_dim=512) -> out[B, H, v_dim]``, D = v_dim + rope. ``page_table[b, i]`` is the cache row of
request b's i-th token (SGLang's req_to_token row, page size 1); ``contiguous_page_table`` builds the table of a
cache laid out request after request. Every request needs at least one token (a decode step always has one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

NUM_KV_SPLITS = 8     # SGLang v0.4's default (server_args.triton_attention_num_kv_splits)
BLOCK_H = 16          # query heads per program: the largest group that still fills one tl.dot row block
BLOCK_N = 32          # context rows per iteration; SGLang's grouped kernel used 32 for MLA
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def attend_rows(q_nope, q_rope, kv_rows, row_mask, score_mask, run_max, run_sum, acc, sm_scale,
                V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                FP32_IEEE: tl.constexpr):
    """One online-softmax step of queries ``q_nope [M, BLOCK_V]``, ``q_rope [M, BLOCK_R]`` over the latent rows at
    ``kv_rows [N, 1]`` (pointers to each row's start; ``row_mask [N]`` the rows that exist, ``score_mask [M, N]``
    the (query, row) pairs that count). Returns the new (running max, running sum, unnormalised output [M, BLOCK_V]).
    One load serves both the scores (with the rope part) and the values: the latent is K and V at once."""
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    latent = tl.load(kv_rows + offs_v[None, :], mask=row_mask[:, None] & (offs_v < V_DIM)[None, :], other=0.0)
    rope = tl.load(kv_rows + V_DIM + offs_r[None, :], mask=row_mask[:, None] & (offs_r < ROPE_DIM)[None, :],
                   other=0.0)
    if FP32_IEEE:
        scores = tl.dot(q_nope, tl.trans(latent), input_precision="ieee")
        scores = tl.dot(q_rope, tl.trans(rope), scores, input_precision="ieee")
    else:
        scores = tl.dot(q_nope, tl.trans(latent))
        scores = tl.dot(q_rope, tl.trans(rope), scores)
    scores = tl.where(score_mask, scores * sm_scale, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(scores, 1))
    rescale = tl.exp(run_max - new_max)
    p = tl.exp(scores - new_max[:, None])
    run_sum = run_sum * rescale + tl.sum(p, 1)
    if FP32_IEEE:
        acc = tl.dot(p.to(latent.dtype), latent, acc * rescale[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(latent.dtype), latent, acc * rescale[:, None])
    return new_max, run_sum, acc


@triton.jit
def mla_decode_stage1_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, num_heads,
    stride_qb, stride_qh, stride_kv, stride_pt, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_SPLITS: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Partial attention of BLOCK_H heads of one request over one split of its context (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < num_heads
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    v_mask = offs_v < V_DIM
    r_mask = offs_r < ROPE_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(seq_len, NUM_KV_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if end > start:   # short contexts leave the last splits empty: they write nothing, stage 2 skips them
        q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q_nope = tl.load(q_rows + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
        q_rope = tl.load(q_rows + V_DIM + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        run_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            rows = tl.load(page_table_ptr + b * stride_pt + offs_n, mask=n_mask, other=0).to(tl.int64)
            run_max, run_sum, acc = attend_rows(
                q_nope, q_rope, kv_ptr + rows[:, None] * stride_kv, n_mask, n_mask[None, :], run_max, run_sum, acc,
                sm_scale, V_DIM, ROPE_DIM, BLOCK_V, BLOCK_R, FP32_IEEE)
        part = part_out_ptr + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_v[None, :]
        tl.store(part, acc / run_sum[:, None], mask=h_mask[:, None] & v_mask[None, :])
        lse = part_lse_ptr + b * stride_plb + heads * stride_plh + split
        tl.store(lse, run_max + tl.log(run_sum), mask=h_mask)


@triton.jit
def mla_decode_stage2_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    V_DIM: tl.constexpr, BLOCK_V: tl.constexpr, NUM_KV_SPLITS: tl.constexpr,
):
    """out[b, h] = the splits' partial outputs weighted by exp(lse - the largest lse), normalised."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(seq_len, NUM_KV_SPLITS)
    run_max = tl.full([1], float("-inf"), tl.float32)
    run_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for split in tl.static_range(NUM_KV_SPLITS):
        if split * per_split < seq_len:   # the same empty splits stage 1 skipped
            lse = tl.load(part_lse_ptr + b * stride_plb + h * stride_plh + split + tl.arange(0, 1))
            part = tl.load(part_out_ptr + b * stride_pob + h * stride_poh + split * stride_pos + offs_v,
                           mask=v_mask, other=0.0)
            new_max = tl.maximum(run_max, lse)
            rescale = tl.exp(run_max - new_max)
            weight = tl.exp(lse - new_max)
            acc = acc * rescale + weight * part
            run_sum = run_sum * rescale + weight
            run_max = new_max
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_v, (acc / run_sum).to(out_ptr.dtype.element_ty),
             mask=v_mask)


def contiguous_page_table(batch: int, max_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The page table of a cache holding request b's tokens at rows ``b * max_len + i`` (int32 ``[B, max_len]``)."""
    return torch.arange(batch * max_len, dtype=torch.int32, device=device).view(batch, max_len)


def _check(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
           v_dim: int) -> torch.Tensor:
    """Validate shapes; return the cache as ``[S, D]``."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    kv = kv_cache.view(kv_cache.shape[0], -1) if kv_cache.dim() == 3 and kv_cache.shape[1] == 1 else kv_cache
    if kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"kv_cache must be [S, D={q.shape[2]}] or [S, 1, D] (one latent KV head), got "
                         f"{tuple(kv_cache.shape)}")
    if not 0 < v_dim < q.shape[2]:
        raise ValueError(f"v_dim={v_dim} must be in (0, D={q.shape[2]}): the value is the latent's first v_dim columns")
    if page_table.dim() != 2 or page_table.shape[0] != q.shape[0] or tuple(seq_lens.shape) != (q.shape[0],):
        raise ValueError(f"page_table must be [B={q.shape[0]}, max_len] and seq_lens [B], got "
                         f"{tuple(page_table.shape)} and {tuple(seq_lens.shape)}")
    if kv.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError("q and kv_cache need unit stride along D")
    return kv


def mla_decode_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    *, v_dim: int = 512, num_kv_splits: int = NUM_KV_SPLITS, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Both stages (module docstring): ``[B, H, v_dim]`` in q's dtype. No host sync, so it captures into a CUDA
    graph. CUDA tensors, or CPU ones when TRITON_INTERPRET=1 was set before this module was imported (float32 and
    float16: the interpreter's bf16 tl.dot is wrong, triton-lang/triton#11584)."""
    kv = _check(q, kv_cache, page_table, seq_lens, v_dim)
    interpreted = isinstance(mla_decode_stage1_kernel, InterpretedFunction)
    if q.device.type != "cuda" and not interpreted:
        raise RuntimeError("mla_decode_triton runs on CUDA, or on the CPU with TRITON_INTERPRET=1 set before "
                           "kernels.mla_decode is imported; mla_decode_torch is the CPU path")
    if interpreted and q.dtype == torch.bfloat16:
        raise ValueError("mla_decode_triton under TRITON_INTERPRET supports float32 and float16, not bfloat16")
    B, H, D = q.shape
    rope_dim = D - v_dim
    part_out = torch.empty((B, H, num_kv_splits, v_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, num_kv_splits), dtype=torch.float32, device=q.device)
    out = q.new_empty((B, H, v_dim))
    block_v, block_r = triton.next_power_of_2(v_dim), max(16, triton.next_power_of_2(rope_dim))
    mla_decode_stage1_kernel[(B, triton.cdiv(H, block_h), num_kv_splits)](
        q, kv, page_table, seq_lens, part_out, part_lse, sm_scale, H,
        q.stride(0), q.stride(1), kv.stride(0), page_table.stride(0), *part_out.stride()[:3], *part_lse.stride()[:2],
        V_DIM=v_dim, ROPE_DIM=rope_dim, BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_KV_SPLITS=num_kv_splits, FP32_IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    mla_decode_stage2_kernel[(B, H)](
        part_out, part_lse, seq_lens, out, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0),
        out.stride(1), V_DIM=v_dim, BLOCK_V=block_v, NUM_KV_SPLITS=num_kv_splits,
    )
    return out


def mla_decode_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    *, v_dim: int = 512, **_: object,
) -> torch.Tensor:
    """The torch twin and oracle: plain softmax attention over each request's latent rows, in fp32 (launch settings
    are accepted and unused). Pads every request to the longest context and masks the padding."""
    kv = _check(q, kv_cache, page_table, seq_lens, v_dim)
    width = int(seq_lens.max())
    rows = kv[page_table[:, :width].long()].float()                                 # [B, L, D]
    scores = torch.einsum("bhd,bld->bhl", q.float(), rows) * sm_scale
    valid = torch.arange(width, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blv->bhv", scores.softmax(-1), rows[..., :v_dim]).to(q.dtype)


def mla_decode_traffic(batch: int, heads: int, context: int, *, v_dim: int = 512, rope_dim: int = 64,
                       itemsize: int = 2, num_kv_splits: int = NUM_KV_SPLITS, block_h: int = BLOCK_H) -> dict:
    """FLOPs and bytes of one call with every request at ``context`` tokens.

    flops: 2 (v_dim + rope_dim) per score plus 2 v_dim per value, per (head, token). bytes: what the kernels load
    and store, each latent row counted once per head block that reads it (L2 may serve repeats; the measurement
    says how much), plus the page-table entries, q, the fp32 partials (stage 1 writes, stage 2 reads) and the out.
    ``latent_once_bytes`` is the latent read once for all heads (what a FlashMLA-style kernel would read)."""
    width = v_dim + rope_dim
    head_blocks = -(-heads // block_h)
    per_split = -(-context // num_kv_splits)
    splits_used = -(-context // per_split)           # the splits stage 1 writes (short contexts leave some empty)
    latent = batch * context * width * itemsize
    partials = batch * heads * splits_used * (v_dim + 1) * 4
    stage1 = head_blocks * (latent + batch * context * 4) + batch * heads * width * itemsize + partials
    stage2 = partials + batch * heads * v_dim * itemsize
    return {"flops": 2.0 * batch * heads * context * (width + v_dim), "bytes": stage1 + stage2,
            "stage1_bytes": stage1, "stage2_bytes": stage2, "latent_once_bytes": latent, "head_blocks": head_blocks}
