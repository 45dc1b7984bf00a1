"""The parallelism interface: how one engine instance spreads over its ranks (a `parallel=` plugin).

The base class is the single-rank behaviour; plugins override what their scheme changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ParallelConfig:
    name: str = "tp"
    size: int = 1
    idle_batches: bool = True               # debug switch: false reproduces the hang IDLE batches prevent
    schedule_conservativeness: float = 1.0   # scales engine.new_token_ratio (SGLang: 0.3 under DP attention)
    dp_balance: str = "round_robin"          # dp_attn: how the in-instance controller picks a rank


class Parallelism:
    Config = ParallelConfig
    replicates_batch = True   # every rank runs the same batch (TP); False: each rank schedules its own (DP attention)

    def __init__(self, cfg: ParallelConfig, group) -> None:
        self.cfg, self.group = cfg, group
        self.stats = {"idle_steps": 0, "graph_eligible_steps": 0, "steps": 0}

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def shard(self, model) -> None:
        """Cut this rank's part out of the full model (every rank built the same weights from the seed)."""

    def kv_bytes_per_token(self, model_cfg) -> int:
        """KV bytes one token costs on this rank. MLA: one latent per token, whoever stores it."""
        return model_cfg.kv_bytes_per_token()

    def attn_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """After the attention output projection (TP: heads are split, so sum the partial outputs)."""
        return x

    def ffn(self, h: torch.Tensor, module, batch) -> torch.Tensor:
        """Run a dense FFN or MoE layer, converting the token layout it needs (`module.token_layout`) and
        reducing partial sums (`module.partial`)."""
        return module(h)

    def sync_step(self, batch):
        """Per-step agreement before the forward (DP attention: token counts, IDLE batches, graph eligibility).
        Returns the batch to run, or None for no step."""
        if batch is not None:
            self.stats["steps"] += 1
        return batch
