"""The oracle: a plain single-process forward with no cache, no plugins, no absorption, no parallelism.

Every other path (engine with KV cache and radix hits, TP, DP attention, every MoE backend and kernel) is checked
against `reference_forward` on a model built from the same seed.
"""
from __future__ import annotations

import torch

from framework.model.layers import MLP, MoE, rope
from framework.model.model import Transformer


def _attention(block, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    attn, c = block.attn, block.attn.cfg
    nh = c.num_heads
    q_in = attn.q_a_norm(x @ attn.q_a.t()) if c.q_lora_rank else x
    q = (q_in @ attn.q_b.t()).view(-1, nh, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    latent, k_pe = (x @ attn.kv_a.t()).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    kv = (attn.kv_a_norm(latent) @ attn.kv_b.t()).view(-1, nh, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_pe = rope(k_pe, positions, c.rope_theta)[:, None, :].expand(-1, nh, -1)
    q = torch.cat([q_nope, rope(q_pe, positions, c.rope_theta)], dim=-1).transpose(0, 1)   # [h, T, d]
    k = torch.cat([k_nope, k_pe], dim=-1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True,
                                                           scale=attn.scale)
    return out.transpose(0, 1).reshape(x.shape[0], -1) @ attn.o.t()


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts, one plain loop: sum_k weight_k * down(silu(gate) * up) of expert topk_ids[t, k]."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for e in range(w13.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w13[e].t()).split(inter, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(x.dtype))
    return out


def _moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    out = experts_reference(x, moe.w13, moe.w2, *moe.route(x))
    if moe.shared is not None:
        out = out + MLP.forward(moe.shared, x)
    return out


@torch.no_grad()
def reference_forward(model: Transformer, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] for every position of one sequence. `model` must be unsharded."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.embed.device)
    positions = torch.arange(ids.shape[0], device=ids.device)
    x = model.embed[ids]
    for block in model.layers:
        if block.attn.num_heads != model.cfg.num_heads:
            raise ValueError("reference_forward needs an unsharded model (build one with build_model)")
        x = x + _attention(block, block.attn_norm(x), positions)
        h = block.ffn_norm(x)
        x = x + (_moe(block.ffn, h) if isinstance(block.ffn, MoE) else block.ffn(h))
    return model.norm(x) @ model.lm_head.t()
