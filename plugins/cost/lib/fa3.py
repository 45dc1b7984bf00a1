"""FlashAttention-3 as SGLang 2025 runs it for DeepSeek (the default attention backend on Hopper: "Attention backend
not set. Use fa3 backend by default", sglang PR #5580's DeepSeek-V3 log, 2025-04-21):

- prefill without a cached prefix: MHA over the expanded keys and values (qk head dim 192, v 128), causal;
  `prefill_tflops` gives FA3's published BF16 forward rate with the causal mask (Dao-AILab/flash-attention
  assets/flash3_fp16_fwd.png, 7ef2484, 2024-07-11, panels (d) head dim 128 and (f) head dim 256, H100 80GB SXM5,
  batch x seqlen = 16k, hidden 2048), by sequence length (linear in log2 between the measured lengths, the nearest
  outside them) and head dimension (linear between 128 and 256 on the mean of the qk and v head dims);
- decode over the MLA latent (q_rope 64 wide, the 512-wide latent as v): `decode_splits` gives the number of KV
  splits FA3's dynamic scheduler picks (flash-attention hopper/ at 934f6ad, 2025-04-17: heuristics.h
  num_splits_heuristic for the static bound with batch 1, flash_prepare_scheduler.cu for the per-batch count; tile
  64 x 64 from tile_size_fwd_sm90(64, 512), the heads packed into the M tile: PackGQA). One split writes no
  partial outputs (FA3 still launches its combine kernel, which returns at once for a request of one split, and
  prepare_varlen_num_blocks: two short kernels a layer, not priced: about 0.03% of a decode step at 256 requests).
"""
from __future__ import annotations

from math import ceil

from framework.gpu.tables import interpolate

CAUSAL_FWD_TFLOPS = {  # head dim -> {sequence length: TFLOPS}
    128: {512: 292, 1024: 423, 2048: 521, 4096: 579, 8192: 602, 16384: 616},
    256: {512: 286, 1024: 427, 2048: 537, 4096: 612, 8192: 628, 16384: 642},
}
DECODE_TILE_M, DECODE_TILE_N = 64, 64     # tile_size_fwd_sm90(headdim=64, headdim_v=512)
L2_BYTES = 50 * 1024 * 1024                # heuristics.h: "we assume that L2 size is 50MB"
MAX_SPLITS = 128


def prefill_tflops(seqlen: float, qk_head_dim: int, v_head_dim: int) -> float:
    """FA3's published causal forward TFLOPS at this sequence length and (mean) head dimension."""
    dims = sorted(CAUSAL_FWD_TFLOPS)
    d = min(max((qk_head_dim + v_head_dim) / 2, dims[0]), dims[-1])
    lo, hi = (interpolate(CAUSAL_FWD_TFLOPS[dim], seqlen, log=True) for dim in (dims[0], dims[-1]))
    return lo + (d - dims[0]) / (dims[-1] - dims[0]) * (hi - lo)


def _static_splits(m_blocks: int, n_blocks: int, kv_head_bytes: int, sms: int) -> int:
    """heuristics.h num_splits_heuristic as get_num_splits calls it under the dynamic scheduler (batch counted 1)."""
    total = m_blocks
    if total >= 0.8 * sms:
        big = kv_head_bytes > L2_BYTES and m_blocks >= sms * 2
        return min(-(-kv_head_bytes // L2_BYTES), MAX_SPLITS) if big else 1
    if n_blocks <= 4:
        return 1
    top = min(MAX_SPLITS, sms, n_blocks)
    eff = [(total * s / sms) / ceil(total * s / sms) for s in range(1, top + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= 0.85 * best)


def decode_splits(requests: int, heads: int, context: float, sms: int, rope_dim: int = 64,
                  latent_dim: int = 512) -> int:
    """KV splits per request of FA3's MLA decode: `requests` each with `heads` query heads over one latent head of
    `context` cached tokens (every request at the mean), on `sms` SMs."""
    if requests <= 0 or context <= 0:
        return 1
    m_blocks = -(-heads // DECODE_TILE_M)
    n_blocks = ceil(context / DECODE_TILE_N)
    static = _static_splits(m_blocks, n_blocks, ceil(context) * (rope_dim + latent_dim) * 2, sms)
    per_sm = ceil(requests * m_blocks * n_blocks * 1.1 / sms)        # flash_prepare_scheduler.cu, 10% margin
    return max(min(-(-n_blocks // per_sm), static), 1)
