"""The parallelism interface: how one engine instance spreads over its ranks (a `parallel=` plugin).

The base class is the single-rank behaviour; plugins override what their scheme changes, and the core asks the
plugin instead of branching on which one runs:

- the instance's layout: `dp_size` independent schedulers ("DP groups"), `dp_rank_of(rank)` for each rank; the ranks
  of one DP group run the same batch (TP: one group of every rank; DP attention: one group per rank), `dispatcher()`
  hands each request to a group, `schedule_conservativeness` scales the admission ratio;
- before any rank starts, from shapes alone (classmethods, so a simulator can size DeepSeek-V3 without building it):
  `check_fits`, `weight_bytes` (this rank's weights by part; the MoE backend adds its routed experts),
  `kv_bytes_per_token`, `layer_comm` / `edge_comm` (what each layer and the embedding/logits communicate);
- per step, on each rank: `sync_step` (carries the DP groups' bids; the step itself is framework/engine/step.py),
  and around the model's parts `embed`, `attn_reduce`, `ffn`, `logits`;
- verify: `check_step_logs`, the per-step protocol checks of the scheme.

A plugin gets two groups: `group` carries the tensors of the forward (NCCL on GPUs) and `control` the scheduling
metadata (per-step token counts, graph eligibility, the instance's request exchange: always gloo on CPU, as SGLang's
`tp_cpu_group`). Separate groups also keep a rank that skipped a step (exercise 1) from pairing its next control
collective with the others' FFN collective: the FFN collective times out, cleanly.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from framework.contracts.dp_controller import DataParallelController
from framework.contracts.step import StepBid
from framework.model.layers import MoE


class CommBackend(enum.StrEnum):
    """torch.distributed's backend for a multi-rank instance's forward collectives (`parallel.backend`)."""
    auto = "auto"     # nccl when the engine runs on CUDA, else gloo
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class ParallelConfig:
    name: str = ""                          # the plugin's key: each plugin's Config names itself
    size: int = 1
    backend: CommBackend = CommBackend.auto
    timeout_s: float = 60.0                  # every forward collective; a rank that skipped one -> CollectiveTimeout
    master_port: int = 0                     # rendezvous port of a multi-rank instance; 0 picks a free one


@dataclass(frozen=True)
class Collective:
    """One collective as a cost model reads it. `kind`: all_reduce | all_gather | reduce_scatter | all_to_all.
    `bytes`: the full buffer, nccl-tests' convention (all_reduce: the tensor; all_gather: the gathered output;
    reduce_scatter: the input; all_to_all: what the busiest rank sends, its own share included), padded to the
    largest rank's rows as the GPU path sends them. `ranks`: the global ranks taking part."""
    kind: str
    bytes: int
    ranks: tuple[int, ...]


def even_split(n: int, size: int) -> list[int]:
    """n rows over `size` ranks, the first n % size ranks one more."""
    return [n // size + (r < n % size) for r in range(size)]


class Parallelism:
    Config = ParallelConfig

    def __init__(self, cfg: ParallelConfig, group, control=None) -> None:
        self.cfg, self.group = cfg, group
        self.control = control if control is not None else group
        self.stats = {"skipped_idle_steps": 0}     # the plugin's own; the step counts steps (engine/step.py)

    @property
    def collectives(self) -> int:
        """The collectives this rank has waited on, over its group and its control group (when it has its own)."""
        return self.group.collectives + (self.control.collectives if self.control is not self.group else 0)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    # -- the instance's layout ------------------------------------------------------------------------------
    @classmethod
    def dp_size(cls, cfg) -> int:
        """Independent schedulers (DP groups) in the instance: each holds its own requests, KV and radix cache."""
        return 1

    @classmethod
    def dp_rank_of(cls, cfg, rank: int) -> int:
        """The DP group of `rank`; the ranks of one group run the same batch and sample the same tokens."""
        return 0

    @property
    def dp_rank(self) -> int:
        return self.dp_rank_of(self.cfg, self.rank)

    @property
    def leads(self) -> bool:
        """The first rank of its DP group: the one that reports the group's outputs and counts its state."""
        return self.rank == 0 or self.dp_rank_of(self.cfg, self.rank - 1) != self.dp_rank

    @classmethod
    def conservativeness(cls, cfg) -> float:
        """Scales engine.new_token_ratio (SGLang: 0.3 under DP attention)."""
        return 1.0

    @property
    def schedule_conservativeness(self) -> float:
        return self.conservativeness(self.cfg)

    @classmethod
    def make_dispatcher(cls, cfg) -> DataParallelController:
        """The instance's choice of a DP group for each request (a classmethod: the simulator builds no rank)."""
        return DataParallelController(cls.dp_size(cfg))

    def dispatcher(self) -> DataParallelController:
        """Rank 0's choice of a DP group for each request."""
        return self.make_dispatcher(self.cfg)

    @classmethod
    def describe(cls, cfg) -> dict:
        """What results.json says about the scheme (its size and the switches that change what it computes)."""
        return {"parallel": cfg.name, "parallel_size": cfg.size, "dp_size": cls.dp_size(cfg)}

    def set_step(self, step: int) -> None:
        """The instance step, named by a collective that times out."""
        self.group.step = self.control.step = step

    # -- from shapes, before any rank starts --------------------------------------------------------------
    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        """Why `cfg.size` ranks cannot split this model under this scheme (empty when they can). Called before any
        rank starts, so a bad size is one message, not a traceback per rank."""
        return []

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, moe_partial: bool) -> dict[str, int]:
        """Bytes of the weights `rank` holds, by part, routed experts excepted (the MoE backend's)."""
        return model_weight_bytes(model_cfg, heads=model_cfg.num_heads, vocab_rows=model_cfg.vocab_size,
                                  ffn_shards=cfg.size, shared_sharded=moe_partial)

    @classmethod
    def kv_bytes_per_token(cls, model_cfg) -> int:
        """KV bytes one token costs on a rank. MLA: one latent per token, whoever stores it."""
        return model_cfg.kv_bytes_per_token()

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens: list[int], ffn_layout: str, ffn_partial: bool) -> list[Collective]:
        """The collectives of one transformer layer when rank r runs tokens[r] tokens, for an FFN of this token
        layout and partiality (a dense FFN: "all", partial on more than one rank; a MoE layer: its backend's
        `layout`). A backend's own collectives (ep's all-to-all) are the backend's to declare."""
        return []

    @classmethod
    def edge_comm(cls, cfg, model_cfg, tokens: list[int], logit_rows: list[int]) -> list[Collective]:
        """The collectives of the embedding lookup and the logits (logit_rows[r]: rows rank r samples from)."""
        return []

    @classmethod
    def check_step_logs(cls, logs: list[list]) -> list[str]:
        """verify: what is wrong in the ranks' step logs (framework.engine.step.StepEntry; index i = the same step
        on every rank)."""
        return []

    # -- on each rank ---------------------------------------------------------------------------------------
    def shard(self, model) -> None:
        """Cut this rank's part out of the full model (every rank built the same weights from the seed)."""

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return table[ids]

    def logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        return x @ lm_head.t()

    def attn_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """After the attention output projection (heads split: sum the partial outputs)."""
        return x

    def ffn(self, h: torch.Tensor, module, batch) -> torch.Tensor:
        """Run a dense FFN or MoE layer, converting the token layout it needs (`module.token_layout`) and
        reducing partial sums (`module.partial`)."""
        return module(h)

    def sync_step(self, bid: StepBid) -> list[StepBid] | None:
        """The per-step exchange before the forward: this rank's DP group's bid in, every DP group's out (in group
        order), the same on every rank; None: this rank sits the step out. One DP group (one rank, or TP's ranks
        sharing one batch): nothing to exchange."""
        return [bid]


# -- shared by the plugins ---------------------------------------------------------------------------------------
def attention_params(model_cfg, heads: int) -> int:
    """Parameters of one MLA layer keeping `heads` heads: q_a, kv_a and their norms are per token, not per head
    (whole on every rank); q_b, kv_b and o are per head."""
    c = model_cfg
    q_in = c.q_lora_rank or c.hidden_size
    whole = (c.kv_lora_rank + c.qk_rope_head_dim) * c.hidden_size + c.kv_lora_rank
    if c.q_lora_rank:
        whole += c.q_lora_rank * c.hidden_size + c.q_lora_rank
    per_head = (c.qk_head_dim * q_in + (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
                + c.hidden_size * c.v_head_dim)
    return whole + heads * per_head


def model_weight_bytes(model_cfg, *, heads: int, vocab_rows: int, ffn_shards: int,
                       shared_sharded: bool) -> dict[str, int]:
    """A rank's weights by part (routed experts excepted): `heads` attention heads per layer, `vocab_rows` rows of
    the embedding and of the lm_head, dense FFNs sliced `ffn_shards` ways, shared experts too when `shared_sharded`.
    Norms and the MoE router are whole on every rank."""
    c = model_cfg
    moe_layers = c.num_layers - c.first_k_dense_replace
    shared = 3 * c.hidden_size * c.n_shared_experts * c.moe_intermediate_size
    params = {
        "embedding": vocab_rows * c.hidden_size,
        "lm_head": vocab_rows * c.hidden_size,
        "attention": c.num_layers * attention_params(c, heads),
        "norms": (2 * c.num_layers + 1) * c.hidden_size,
        "dense_ffn": c.first_k_dense_replace * 3 * c.hidden_size * c.intermediate_size // ffn_shards,
        "shared_experts": moe_layers * shared // (ffn_shards if shared_sharded else 1),
        "moe_gate": moe_layers * c.n_routed_experts * (c.hidden_size + 1),   # gate + correction bias
    }
    linear = ("attention", "dense_ffn", "shared_experts")       # what an fp8 checkpoint stores in one byte
    return {part: n * (c.linear_itemsize if part in linear else c.itemsize) for part, n in params.items()}


def ffn_shard_problems(model_cfg, size: int, moe_partial: bool) -> list[str]:
    """The FFN side, the same under every scheme: dense layers are tensor-parallel (intermediate dim sliced) across
    all ranks, and shared experts are sliced exactly when the routed backend returns partial sums."""
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

