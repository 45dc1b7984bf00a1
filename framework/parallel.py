"""The parallelism interface: how one engine instance spreads over its ranks (a `parallel=` plugin).

The base class is the single-rank behaviour; plugins override what their scheme changes. A plugin gets two groups:
`group` carries the tensors of the forward (attention reduction, the FFN/MoE token layout: NCCL on GPUs) and
`control` the scheduling metadata (per-step token counts, graph eligibility, the instance's request exchange: always
gloo on CPU, as SGLang's `tp_cpu_group`). Separate groups also keep a rank that skipped a step (exercise 1) from
pairing its next control collective with the others' FFN collective: the FFN collective times out, cleanly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.model.layers import MoE


@dataclass
class ParallelConfig:
    name: str = "tp"
    size: int = 1
    idle_batches: bool = True               # debug switch: false reproduces the hang IDLE batches prevent
    schedule_conservativeness: float = 1.0   # scales engine.new_token_ratio (SGLang: 0.3 under DP attention)
    dp_balance: str = "round_robin"          # dp_attn: how the in-instance controller picks a rank
    backend: str = "auto"                   # auto (nccl when the engine runs on CUDA, else gloo) | gloo | nccl
    timeout_s: float = 60.0                  # every forward collective; a rank that skipped one -> CollectiveTimeout
    master_port: int = 0                     # rendezvous port of a multi-rank instance; 0 picks a free one


class Parallelism:
    Config = ParallelConfig
    replicates_batch = True   # every rank runs the same batch (TP); False: each rank schedules its own (DP attention)

    def __init__(self, cfg: ParallelConfig, group, control=None) -> None:
        self.cfg, self.group = cfg, group
        self.control = control if control is not None else group
        self.stats = {"idle_steps": 0, "graph_eligible_steps": 0, "steps": 0, "skipped_idle_steps": 0}
        self.step_log: list[dict] | None = None   # verify/tests set a list: one record per sync_step that ran

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def sampling_seed_offset(self) -> int:
        """Added to the sampling generator's seed: ranks that run the same batch must draw the same tokens."""
        return 0 if self.replicates_batch else self.rank

    @classmethod
    def check_fits(cls, model_cfg, size: int, moe_partial: bool) -> list[str]:
        """Why `size` ranks cannot split this model under this scheme (empty when they can). Called before any
        rank starts, so a bad size is one message, not a traceback per rank."""
        return []

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
        Returns the batch to run, or None for no step. One rank (and TP, whose ranks share one batch): a decode
        step could replay a captured graph."""
        if batch is not None:
            batch.can_run_graph = batch.mode.is_decode()
            self.stats["steps"] += 1
            self.stats["graph_eligible_steps"] += batch.can_run_graph
        return batch


def ffn_shard_problems(model_cfg, size: int, moe_partial: bool) -> list[str]:
    """The FFN side, the same under both schemes: dense layers are tensor-parallel (intermediate dim sliced), and
    shared experts are sliced exactly when the routed backend returns partial sums."""
    problems = []
    if model_cfg.first_k_dense_replace and model_cfg.intermediate_size % size:
        problems.append(f"model.intermediate_size={model_cfg.intermediate_size} (dense FFN, tensor-parallel) is not "
                        f"divisible by parallel.size={size}")
    shared = model_cfg.n_shared_experts * model_cfg.moe_intermediate_size
    if moe_partial and shared and shared % size:
        problems.append(f"the shared experts' intermediate size {shared} (n_shared_experts x moe_intermediate_size) "
                        f"is not divisible by parallel.size={size}, and this moe backend needs them sliced")
    return problems


def shard_ffns(model, rank: int, size: int) -> None:
    """Slice the dense FFNs; slice the shared experts iff the routed backend's output is partial."""
    for block in model.layers:
        ffn = block.ffn
        if isinstance(ffn, MoE):
            if ffn.backend.token_layout == "local" and ffn.backend.partial:
                raise ValueError(f"moe backend {type(ffn.backend).__name__} declares token_layout='local' with "
                                 "partial=True: each rank holds different tokens, so partial sums cannot be reduced")
            if ffn.shared is not None and ffn.backend.partial:
                ffn.shared.shard(rank, size)
        elif size > 1:
            ffn.shard(rank, size)
