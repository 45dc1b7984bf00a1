"""The model's shape: a DeepSeek-V2-style MLA + MoE transformer, small enough for a CPU."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Gating(enum.StrEnum):
    """How the MoE router scores experts and groups (`model.gating`)."""
    v2 = "v2"   # DeepSeek-V2: softmax, group score = max
    v3 = "v3"   # DeepSeek-V3: sigmoid + correction bias, group score = top-2 sum


class DType(enum.StrEnum):
    """The torch dtype of the weights, activations and KV (`model.dtype`)."""
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WeightDtype(enum.StrEnum):
    """How a checkpoint stores the linear layers' weights, when not in `dtype` (`model.weight_dtype`)."""
    fp8 = "fp8"


WEIGHT_DTYPES = (None, *(d.value for d in WeightDtype))
GATINGS = tuple(g.value for g in Gating)
DTYPES = tuple(d.value for d in DType)


@dataclass
class ModelConfig:
    name: str = "tiny_mla_moe"
    vocab_size: int = 260            # 256 UTF-8 bytes + specials (see tokenizer.py)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 8
    q_lora_rank: Optional[int] = 64   # None: q comes straight from hidden (DeepSeek-V2-Lite)
    kv_lora_rank: int = 64            # the compressed latent the KV cache stores
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16        # the decoupled RoPE key, also cached (shared by all heads)
    v_head_dim: int = 16
    intermediate_size: int = 256      # dense FFN of the first `first_k_dense_replace` layers
    moe_intermediate_size: int = 64   # per routed / shared expert
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    n_group: int = 4                  # grouped top-k: experts in n_group groups,
    topk_group: int = 2               # tokens may only pick experts of their topk_group best groups
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    gating: Gating = Gating.v2
    first_k_dense_replace: int = 1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 16384
    dtype: DType = DType.float32
    # the linear layers' weights as the checkpoint stores them (attention projections, dense FFNs, shared and routed
    # experts); None: `dtype`. fp8: one byte each (DeepSeek-V3's own format, DeepSeek-Coder-V2-Instruct-FP8), the
    # embedding, lm_head, norms and MoE gate staying in `dtype`. mode=sim only: it sizes the KV pool and prices fp8
    # GEMMs at the fp8 peak; the CPU engine builds `dtype` weights
    weight_dtype: Optional[WeightDtype] = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per layer: the latent plus the RoPE key, nothing per head."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def itemsize(self) -> int:
        """Bytes of one value of `dtype` (weights and KV)."""
        import torch
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def linear_itemsize(self) -> int:
        """Bytes of one linear-layer weight (`weight_dtype`, else `dtype`)."""
        return 1 if self.weight_dtype == WeightDtype.fp8 else self.itemsize

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_cache_width * self.itemsize

    def validate(self) -> None:
        problems = []
        if self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // max(self.n_group, 1)
        if self.num_experts_per_tok > self.topk_group * per_group:
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in "
                            f"topk_group={self.topk_group} groups ({self.topk_group * per_group})")
        if self.gating not in GATINGS:
            problems.append(f"gating={self.gating!r} is not one of {', '.join(GATINGS)}")
        if self.gating == Gating.v3 and per_group < 2:
            problems.append("gating=v3 scores groups by their top-2 experts: each group needs at least 2 experts")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            problems.append(f"first_k_dense_replace={self.first_k_dense_replace} must be in 0..num_layers")
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            problems.append(f"weight_dtype={self.weight_dtype!r} is not one of {', '.join(map(str, WEIGHT_DTYPES))}")
        if problems:
            raise ValueError("model config: " + "; ".join(problems))
