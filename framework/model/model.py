"""The tiny DeepSeek-style transformer: embeddings, MLA + (dense FFN | MoE) blocks, RMSNorm, LM head."""
from __future__ import annotations

import math

import torch
from torch import nn

from framework.model.attention import MLAttention, attention_metadata
from framework.model.config import ModelConfig
from framework.model.layers import MLP, MoE, RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size) if layer_id < cfg.first_k_dense_replace else MoE(cfg)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoE)]

    @torch.no_grad()
    def forward(self, batch, kv_pool, par) -> torch.Tensor:
        """One engine step. `batch`: a ForwardBatch; `kv_pool.layer(i)`: layer i's cache [slots, width];
        `par`: the parallelism plugin (the embedding lookup and logits of a vocabulary slice, the attention
        reduction and the token layout around each FFN).

        Returns logits [num_requests, vocab] of each request's last token (all extend tokens when
        batch.return_all_logits). An IDLE batch has no tokens: it skips attention and logits but runs every FFN,
        so it joins the collectives the other ranks make there.
        """
        idle = batch.mode.is_idle()
        if not idle:
            batch.attn_metadata = attention_metadata(batch)
        x = par.embed(self.embed, batch.input_ids)
        if batch.row_mask is not None:   # a graph's padding rows start at zero and, with no biases, stay zero
            x = x * batch.row_mask[:, None]
        for i, block in enumerate(self.layers):
            if not idle:
                x = x + par.attn_reduce(block.attn(block.attn_norm(x), batch, kv_pool.layer(i)))
            x = x + par.ffn(block.ffn_norm(x), block.ffn, batch)
        if idle:
            return x.new_zeros(0, self.cfg.vocab_size)
        if not (batch.return_all_logits or batch.mode.is_decode()):   # decode: every row is a last token
            x = x[batch.last_token_index]
        return par.logits(self.norm(x), self.lm_head)


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Random weights from `seed` alone: every rank (and the reference) builds the same model bit for bit."""
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "_norm." in name:
            continue                                          # RMSNorm weights stay 1
        if name.endswith("correction_bias"):
            p.data.normal_(0.0, 0.1, generator=gen)
        elif name == "embed":
            p.data.normal_(0.0, 1.0, generator=gen)
        else:
            fan_in = p.shape[-1]
            scale = depth_scale if name.endswith((".o", ".down", ".w2")) else 1.0
            p.data.normal_(0.0, scale / math.sqrt(fan_in), generator=gen)
    model.requires_grad_(False)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))
