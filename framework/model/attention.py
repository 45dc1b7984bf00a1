"""Multi-head latent attention (DeepSeek-V2) over a token-level KV pool.

The cache holds, per token per layer, only the normalised latent c (kv_lora_rank) and the roped key k_pe
(qk_rope_head_dim), whatever the head count. As SGLang v0.4's deepseek_v2.py (DeepseekV2AttentionMLA.forward):
an EXTEND batch with no cached prefix at all decompresses its tokens' latents into per-head keys and values
(forward_normal); decode, and an extend batch where any request has a cached prefix, use the weight-absorbed form
(forward_absorb): q_nope is folded into latent space (W_UK) and the output lifted back per head (W_UV), so nothing
per head is materialised for cached tokens and a long prefix costs one pass over its latents, not a decompression.

A request's KV slots are read through the req_to_token table; `attention_metadata` turns the batch's rows into the
indices every layer uses, once per forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from framework.model.config import ModelConfig
from framework.model.layers import RMSNorm, rope


@dataclass
class AttentionMetadata:
    slots: list[torch.Tensor] | None = None       # extend: each request's slots, prefix + new (views of its row)
    absorbed: bool = False                       # extend: some request has a cached prefix
    kv_index: torch.Tensor | None = None          # decode: [B, Lmax] slots, row by row
    kv_mask: torch.Tensor | None = None           # decode: [B, Lmax] True where a slot is the request's


def attention_metadata(batch) -> AttentionMetadata:
    """What every layer of this forward reads: built once from the req_to_token table (one gather for decode).
    Decode reads `batch.kv_width` slots per row (a captured graph's fixed width), by default the longest context;
    the mask drops each row's slots past its length."""
    table = batch.req_to_token
    if batch.mode.is_decode():
        width = batch.kv_width or max(batch.seq_lens_cpu)
        index = table[batch.req_pool_indices, :width].long()
        mask = torch.arange(width, device=table.device)[None, :] < batch.seq_lens[:, None]
        return AttentionMetadata(kv_index=index, kv_mask=mask)
    slots = [table[row, :n].long() for row, n in zip(batch.req_pool_indices_cpu, batch.seq_lens_cpu)]
    return AttentionMetadata(slots=slots, absorbed=any(batch.prefix_lens))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_heads   # local heads: a parallelism plugin may keep a slice (`shard_heads`)
        h, nh = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank:
            self.q_a = nn.Parameter(torch.empty(cfg.q_lora_rank, h))
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b = nn.Parameter(torch.empty(nh * cfg.qk_head_dim, cfg.q_lora_rank))
        else:
            self.q_b = nn.Parameter(torch.empty(nh * cfg.qk_head_dim, h))
        self.kv_a = nn.Parameter(torch.empty(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h))
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b = nn.Parameter(torch.empty(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        self.o = nn.Parameter(torch.empty(h, nh * cfg.v_head_dim))
        self.scale = 1.0 / math.sqrt(cfg.qk_head_dim)

    def shard_heads(self, rank: int, size: int) -> None:
        """Keep heads [rank*n/size, (rank+1)*n/size); the o projection becomes row-parallel (partial sums)."""
        c = self.cfg
        if c.num_heads % size:
            raise ValueError(f"num_heads={c.num_heads} is not divisible by parallel.size={size}")
        n = c.num_heads // size
        heads = slice(rank * n, (rank + 1) * n)

        def rows(w: torch.Tensor, per_head: int) -> nn.Parameter:
            return nn.Parameter(w.data.view(c.num_heads, per_head, -1)[heads].reshape(n * per_head, -1).contiguous())
        self.q_b = rows(self.q_b, c.qk_head_dim)
        self.kv_b = rows(self.kv_b, c.qk_nope_head_dim + c.v_head_dim)
        self.o = nn.Parameter(self.o.data.view(-1, c.num_heads, c.v_head_dim)[:, heads].reshape(-1, n * c.v_head_dim)
                              .contiguous())
        self.num_heads = n

    # -- projections ---------------------------------------------------------------------------------------
    def project_q(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        q_in = self.q_a_norm(x @ self.q_a.t()) if c.q_lora_rank else x
        q = (q_in @ self.q_b.t()).view(-1, self.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return q_nope, rope(q_pe, positions, c.rope_theta)

    def project_latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """-> [T, kv_lora_rank + qk_rope_head_dim]: exactly what the cache stores."""
        c = self.cfg
        latent, k_pe = (x @ self.kv_a.t()).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_norm(latent), rope(k_pe, positions, c.rope_theta)], dim=-1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, kv_lora] and W_UV [h, v, kv_lora], views of kv_b."""
        c = self.cfg
        w = self.kv_b.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    # -- attention over the cache ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch, kv: torch.Tensor) -> torch.Tensor:
        """x: [T, H] hidden of this step's tokens; kv: this layer's pool [slots, width]; batch.attn_metadata from
        `attention_metadata`. Returns [T, H] (a partial sum when heads are sharded)."""
        kv[batch.out_cache_loc] = self.project_latent(x, batch.positions).to(kv.dtype)
        q_nope, q_pe = self.project_q(x, batch.positions)
        meta = batch.attn_metadata
        if batch.mode.is_decode():
            out = self._decode(q_nope, q_pe, meta, kv)
        elif meta.absorbed:
            out = self._extend_absorbed(q_nope, q_pe, batch, meta, kv)
        else:
            out = self._extend_normal(q_nope, q_pe, batch, meta, kv)
        return out.reshape(x.shape[0], -1) @ self.o.t()

    def _extend_normal(self, q_nope, q_pe, batch, meta, kv) -> torch.Tensor:
        """No cached prefix: per request, decompress its tokens' latents, causal attention over them."""
        c = self.cfg
        outs, start = [], 0
        for slots, n in zip(meta.slots, batch.extend_lens):
            latent, k_pe = kv[slots].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv_heads = (latent @ self.kv_b.t()).view(-1, self.num_heads, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv_heads.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            qn, qp = q_nope[start:start + n], q_pe[start:start + n]
            scores = (torch.einsum("qhd,khd->hqk", qn, k_nope) + torch.einsum("qhd,kd->hqk", qp, k_pe)) * self.scale
            outs.append(torch.einsum("hqk,khd->qhd", self._causal_softmax(scores, n), v))
            start += n
        return torch.cat(outs) if outs else q_nope.new_zeros(0, self.num_heads, c.v_head_dim)

    def _extend_absorbed(self, q_nope, q_pe, batch, meta, kv) -> torch.Tensor:
        """Some request has a cached prefix: per request, causal attention of its new tokens over prefix + new
        tokens in latent space."""
        c = self.cfg
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        outs, start = [], 0
        for slots, n in zip(meta.slots, batch.extend_lens):
            latent, k_pe = kv[slots].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            ql, qp = q_latent[start:start + n], q_pe[start:start + n]
            scores = (torch.einsum("qhc,kc->hqk", ql, latent) + torch.einsum("qhr,kr->hqk", qp, k_pe)) * self.scale
            outs.append(torch.einsum("hqk,kc->qhc", self._causal_softmax(scores, n), latent))
            start += n
        o_latent = torch.cat(outs) if outs else q_latent.new_zeros(0, self.num_heads, c.kv_lora_rank)
        return torch.einsum("thc,hvc->thv", o_latent, w_uv)

    @staticmethod
    def _causal_softmax(scores: torch.Tensor, n_new: int) -> torch.Tensor:
        """scores [h, n_new, L]: the new tokens are the last n_new of L."""
        length = scores.shape[-1]
        causal = torch.ones(n_new, length, dtype=torch.bool, device=scores.device).tril(length - n_new)
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)

    def _decode(self, q_nope, q_pe, meta, kv) -> torch.Tensor:
        """Weight-absorbed decode over the [B, Lmax] slot index."""
        c = self.cfg
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)              # [B, h, kv_lora]
        latent, k_pe = kv[meta.kv_index].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)   # [B, L, .]
        scores = (torch.einsum("bhc,blc->bhl", q_latent, latent) + torch.einsum("bhr,blr->bhl", q_pe, k_pe)) * self.scale
        probs = scores.masked_fill(~meta.kv_mask[:, None, :], float("-inf")).softmax(dim=-1)
        o_latent = torch.einsum("bhl,blc->bhc", probs, latent)
        return torch.einsum("bhc,hvc->bhv", o_latent, w_uv)
