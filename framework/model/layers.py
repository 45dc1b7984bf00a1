"""Building blocks: RMSNorm, RoPE, the SiLU-gated MLP and the MoE layer."""
from __future__ import annotations

import torch
from torch import nn

from framework.model.config import ModelConfig
from framework.model.gating import select_experts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, ..., d], positions: [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]          # [T, d/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().view(shape).to(x.dtype), angles.sin().view(shape).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    """SiLU-gated FFN: the dense layers and the shared experts. `gate_up` holds gate rows then up rows.

    A parallelism plugin may slice the intermediate dim across ranks (`shard`); the output is then a partial sum.
    """

    token_layout = "all"

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(hidden, intermediate))
        self.partial = False

    def shard(self, rank: int, size: int) -> None:
        inter = self.down.shape[1]
        if inter % size:
            raise ValueError(f"intermediate size {inter} is not divisible by parallel.size={size}")
        part, lo = inter // size, rank * (inter // size)
        gate, up = self.gate_up.data.split(inter)
        self.gate_up = nn.Parameter(torch.cat([gate[lo:lo + part], up[lo:lo + part]]).contiguous())
        self.down = nn.Parameter(self.down.data[:, lo:lo + part].contiguous())
        self.partial = size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.t()).chunk(2, dim=-1)
        return (nn.functional.silu(gate) * up) @ self.down.t()


class MoE(nn.Module):
    """Router + routed experts (through the `moe=` backend) + shared experts added outside the routed path."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Parameter(torch.empty(e, h))
        self.correction_bias = nn.Parameter(torch.zeros(e))   # used by gating=v3 only
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared = MLP(h, cfg.n_shared_experts * i) if cfg.n_shared_experts else None
        self.backend = None   # a framework.contracts.moe.MoEBackend, attached by the engine builder
        # Routed slots per expert since the last reset, as this rank saw them (framework/model/moe_stats.py reads it).
        self.register_buffer("expert_counts", torch.zeros(e, dtype=torch.int64), persistent=False)

    @property
    def backend(self):
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        """Attached by the engine builder; a backend that places experts by load reads this layer's counts."""
        self._backend = backend
        if hasattr(backend, "observe_loads"):
            backend.observe_loads(self.expert_counts)

    @property
    def token_layout(self) -> str:
        return self.backend.token_layout

    @property
    def partial(self) -> bool:
        shared_partial = self.shared is not None and self.shared.partial
        if self.shared is not None and shared_partial != self.backend.partial:
            raise RuntimeError("shared experts and the routed backend disagree on partial sums; shard them alike")
        return self.backend.partial

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return select_experts(x @ self.gate.t(), top_k=c.num_experts_per_tok, n_group=c.n_group,
                              topk_group=c.topk_group, gating=c.gating,
                              routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
                              correction_bias=self.correction_bias if c.gating == "v3" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x)
        # no host sync, unlike bincount; a CUDA graph's padding rows are exactly zero (model.forward): not counted
        real = x.ne(0).any(dim=-1, keepdim=True).expand_as(topk_ids)
        self.expert_counts.index_add_(0, topk_ids.reshape(-1), real.reshape(-1).long())
        out = self.backend.forward(x, topk_ids, topk_weights.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out
