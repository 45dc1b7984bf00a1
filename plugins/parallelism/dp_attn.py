"""parallel=dp_attn: data-parallel attention for MLA models (SGLang #1970, #2061, #2096).

Each rank keeps the whole attention, embedding and lm_head (SGLang v0.4 replicates them: ReplicatedLinear) and its
own scheduler, requests, KV pool and radix cache, so the latent KV of a token lives on one rank only. The FFN layers
stay shared across the ranks. Around each dense FFN / MoE layer, `parallel.ffn_comm` says how tokens move:

- `padded_all_gather` (default, SGLang v0.4's DecoderLayer): all-gather every rank's hidden states padded to the
  largest count, run the layer on all tokens, all-reduce its partial sums (the MLP's own reduction), keep this rank's
  rows;
- `reduce_scatter` (servelab's switch): the same gather, then a reduce-scatter hands each rank only its rows' sums,
  half the bytes of the all-reduce.

Every step exchanges the DP groups' bids through `sync_step`, SGLang's `prepare_dp_attn_batch`; the step that
decides from them (IDLE batches, graph eligibility) is framework/engine/step.py.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from framework.contracts.dp_controller import DataParallelController, DPBalance, PrefixRule
from framework.contracts.parallel import Collective, Parallelism, ParallelConfig, ffn_shard_problems, shard_ffns
from framework.contracts.step import StepBid
from framework.core.registry import PARALLELISM
from plugins.parallelism.lib.phase import tell_phase


class FFNComm(enum.Enum):
    padded_all_gather = "padded_all_gather"   # SGLang v0.4
    reduce_scatter = "reduce_scatter"         # servelab: half the bytes after the FFN


@dataclass
class DPAttnConfig(ParallelConfig):
    name: str = "dp_attn"
    size: int = 2
    idle_batches: bool = True                # debug switch: false reproduces the hang IDLE batches prevent
    schedule_conservativeness: float = 0.3   # scales engine.new_token_ratio (SGLang #2096)
    dp_balance: DPBalance = DPBalance.round_robin   # how rank 0's controller picks a DP group for a request
    # dp_balance=cache_aware|precise (servelab; framework/contracts/dp_controller.py): sgl-router's rule per DP group
    dp_block_size: int = 16                 # tokens per hashed block of the groups' prefix views (precise: the
                                            # block size each group's radix cache publishes its KV events in)
    dp_cache_threshold: float = 0.5         # the best group must match more than this share of the prompt
    dp_balance_abs_threshold: int = 32      # loads imbalanced (then: shortest queue) past this difference ...
    dp_balance_rel_threshold: float = 1.0001   # ... and this ratio
    dp_tree_max_tokens: int = 1 << 22       # cache_aware: tokens each group's approximate view remembers
    ffn_comm: FFNComm = FFNComm.padded_all_gather


@PARALLELISM.register("dp_attn")
class DPAttention(Parallelism):
    Config = DPAttnConfig

    @classmethod
    def dp_size(cls, cfg) -> int:
        return cfg.size

    @classmethod
    def dp_rank_of(cls, cfg, rank: int) -> int:
        return rank

    @classmethod
    def conservativeness(cls, cfg) -> float:
        return cfg.schedule_conservativeness

    @classmethod
    def make_dispatcher(cls, cfg) -> DataParallelController:
        rule = PrefixRule(cfg.dp_block_size, cfg.dp_cache_threshold, cfg.dp_balance_abs_threshold,
                          cfg.dp_balance_rel_threshold, cfg.dp_tree_max_tokens)
        return DataParallelController(cls.dp_size(cfg), cfg.dp_balance, rule)

    @classmethod
    def describe(cls, cfg) -> dict:
        return {**super().describe(cfg), "ffn_comm": cfg.ffn_comm.value}

    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        return ffn_shard_problems(model_cfg, cfg.size, moe_partial)

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens, ffn_layout, ffn_partial):
        if cfg.size == 1 or ffn_layout == "local":     # "local": the backend moves the tokens itself
            return []
        return ffn_comm(cfg, tokens, model_cfg.hidden_size * model_cfg.itemsize, ffn_partial)

    @classmethod
    def check_step_logs(cls, logs: list[list]) -> list[str]:
        """Lockstep (every rank ran the same steps and saw the same counts), no step where every group had 0 tokens,
        IDLE exactly where a group had none, graph eligibility exactly when every group was in decode or idle."""
        if len({len(log) for log in logs}) != 1:
            return [f"DP ranks ran different numbers of steps: {[len(log) for log in logs]}"]
        for i, step in enumerate(zip(*logs)):
            counts = step[0].tokens
            if any(s.tokens != counts for s in step):
                return [f"step {i}: ranks saw different token counts"]
            if not any(counts):
                return [f"step {i}: a step ran although every group had 0 tokens"]
            for rank, s in enumerate(step):
                for g in s.groups:
                    if (g.mode == "idle") != (counts[g.group] == 0):
                        return [f"step {i}: rank {rank} ran {g.mode} with {counts[g.group]} tokens"]
            graph = all(g.mode in ("decode", "idle") for s in step for g in s.groups)
            if any(s.graph_eligible != graph for s in step):
                return [f"step {i}: graph eligibility disagrees with the groups' modes"]
        return []

    def shard(self, model) -> None:
        shard_ffns(model, self.rank, self.size)   # attention, embedding and lm_head stay whole on every rank

    def ffn(self, h, module, batch):
        tell_phase(module, batch.can_run_graph)   # every group decoding or idle (the step's graph eligibility)
        if self.size == 1 or module.token_layout == "local":
            return module(h)                      # "local": the backend moves tokens itself (an IDLE rank passes 0)
        return self.ffn_over(h, module, batch.global_num_tokens)

    def ffn_over(self, h, module, counts: list[int]) -> torch.Tensor:
        """The layer on every rank's rows (rank r holds counts[r]); returns this rank's rows of the output."""
        out = module(self.group.all_gather_uneven(h, counts))
        start = sum(counts[: self.rank])
        if not module.partial:
            return out[start:start + counts[self.rank]]
        if self.cfg.ffn_comm is FFNComm.reduce_scatter:
            return self.group.reduce_scatter_uneven(out, counts)
        return self.group.all_reduce(out, "sum")[start:start + counts[self.rank]]

    def sync_step(self, bid: StepBid) -> list[StepBid] | None:
        """SGLang's prepare_dp_attn_batch: every rank's bid (token count, decode or idle, running requests) to every
        rank in one all-gather on the control group; the DP groups' bids, each from its first rank. With
        parallel.idle_batches=false a rank without a batch sits out a step the others run (exercise 1)."""
        if self.size == 1:
            return [bid]
        mine = torch.tensor([[bid.tokens, int(bid.graphable), bid.running]], dtype=torch.int64)
        rows = self.control.all_gather_uneven(mine, [1] * self.size).tolist()
        firsts: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            firsts.setdefault(self.dp_rank_of(self.cfg, rank), row)
        bids = [StepBid(tokens, bool(graphable), running) for tokens, graphable, running in firsts.values()]
        if not self.cfg.idle_batches and bid.tokens == 0 and any(b.tokens for b in bids):
            self.stats["skipped_idle_steps"] += 1
            return None
        return bids

def ffn_comm(cfg, counts: list[int], row_bytes: int, partial: bool) -> list[Collective]:
    """`ffn_over`'s collectives when rank r holds counts[r] rows of `row_bytes`."""
    ranks, padded = tuple(range(cfg.size)), cfg.size * max(counts) * row_bytes
    out = [Collective("all_gather", padded, ranks)]
    if partial and cfg.ffn_comm is FFNComm.reduce_scatter:
        out.append(Collective("reduce_scatter", padded, ranks))
    elif partial:
        out.append(Collective("all_reduce", sum(counts) * row_bytes, ranks))
    return out
