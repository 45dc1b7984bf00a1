"""parallel=dp_attn: data-parallel attention for MLA models (SGLang #1970, #2061, #2096).

Each rank keeps the whole attention, embedding and lm_head (SGLang v0.4 replicates them: ReplicatedLinear) and its
own scheduler, requests, KV pool and radix cache, so the latent KV of a token lives on one rank only. The FFN layers
stay shared across the ranks. Around each dense FFN / MoE layer, `parallel.ffn_comm` says how tokens move:

- `padded_all_gather` (default, SGLang v0.4's DecoderLayer): all-gather every rank's hidden states padded to the
  largest count, run the layer on all tokens, all-reduce its partial sums (the MLP's own reduction), keep this rank's
  rows;
- `reduce_scatter` (servelab's switch): the same gather, then a reduce-scatter hands each rank only its rows' sums,
  half the bytes of the all-reduce.

Every step starts with `sync_step`, SGLang's `prepare_dp_attn_batch`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from framework.contracts.batch import ForwardBatch
from framework.contracts.dp_controller import DataParallelController
from framework.contracts.parallel import Collective, Parallelism, ParallelConfig, ffn_shard_problems, shard_ffns
from framework.core.registry import PARALLELISM


class DPBalance(enum.Enum):
    round_robin = "round_robin"
    shortest_queue = "shortest_queue"


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
        return DataParallelController(cls.dp_size(cfg), cfg.dp_balance.value)

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
    def check_step_logs(cls, logs: list[list[dict]]) -> list[str]:
        """Lockstep (every rank ran the same steps and saw the same counts), no step where every rank had 0 tokens,
        IDLE exactly where a rank had none, can_run_graph exactly when every rank was in decode or idle."""
        if len({len(log) for log in logs}) != 1:
            return [f"DP ranks ran different numbers of steps: {[len(log) for log in logs]}"]
        for i, step in enumerate(zip(*logs)):
            counts = step[0]["counts"]
            if any(s["counts"] != counts for s in step):
                return [f"step {i}: ranks saw different token counts"]
            if counts == [0] * len(counts):
                return [f"step {i}: a step ran although every rank had 0 tokens"]
            for rank, s in enumerate(step):
                if (s["mode"] == "idle") != (counts[rank] == 0):
                    return [f"step {i}: rank {rank} ran {s['mode']} with {counts[rank]} tokens"]
            graph = all(s["mode"] in ("decode", "idle") for s in step)
            if any(s["can_run_graph"] != graph for s in step):
                return [f"step {i}: can_run_graph disagrees with the ranks' modes"]
        return []

    def shard(self, model) -> None:
        shard_ffns(model, self.rank, self.size)   # attention, embedding and lm_head stay whole on every rank

    def ffn(self, h, module, batch):
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

    def sync_step(self, batch: ForwardBatch | None) -> ForwardBatch | None:
        """All-gather the token counts (decode: batch size, extend: extend tokens, none: 0); all zero -> no step on
        any rank; a rank without a batch runs an IDLE one; all-reduce MIN of "decode or idle" -> can_run_graph."""
        if self.size == 1:
            return super().sync_step(batch)
        if batch is None:
            mine = 0
        elif batch.mode.is_decode():
            mine = len(batch.reqs)
        else:
            mine = batch.num_tokens
        counts = self.control.all_gather_counts(mine)
        if max(counts) == 0:
            return None                           # every rank saw the same counts: every rank skips
        decode_or_idle = batch is None or batch.mode.is_decode() or batch.mode.is_idle()
        flag = self.control.all_reduce(torch.tensor([int(decode_or_idle)], dtype=torch.int32), "min")
        if batch is None:
            if not self.cfg.idle_batches:         # exercise 1: skip the step; the others' FFN collective times out
                self.stats["skipped_idle_steps"] += 1
                return None
            batch = ForwardBatch.idle()
            self.stats["idle_steps"] += 1
        batch.global_num_tokens = counts
        batch.can_run_graph = bool(flag.item() == 1)
        self.stats["steps"] += 1
        self.stats["graph_eligible_steps"] += batch.can_run_graph
        if self.step_log is not None:
            self.step_log.append({"mode": batch.mode.value, "counts": counts, "can_run_graph": batch.can_run_graph})
        return batch


def ffn_comm(cfg, counts: list[int], row_bytes: int, partial: bool) -> list[Collective]:
    """`ffn_over`'s collectives when rank r holds counts[r] rows of `row_bytes`."""
    ranks, padded = tuple(range(cfg.size)), cfg.size * max(counts) * row_bytes
    out = [Collective("all_gather", padded, ranks)]
    if partial and cfg.ffn_comm is FFNComm.reduce_scatter:
        out.append(Collective("reduce_scatter", padded, ranks))
    elif partial:
        out.append(Collective("all_reduce", sum(counts) * row_bytes, ranks))
    return out
