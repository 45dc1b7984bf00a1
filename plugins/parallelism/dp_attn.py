"""parallel=dp_attn: data-parallel attention for MLA models (SGLang #1970, #2061, #2096).

Each rank keeps the whole attention and its own scheduler, requests, KV pool and radix cache, so the latent KV of a
token lives on one rank only. The FFN layers stay shared: before each dense FFN / MoE layer the ranks' tokens are
gathered (uneven counts), after it each rank takes its own rows back (a reduce-scatter when the layer's output is a
partial sum). Every step starts with `sync_step`, SGLang's `prepare_dp_attn_batch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.engine.batch import ForwardBatch
from framework.parallel import Parallelism, ParallelConfig, ffn_shard_problems, shard_ffns
from framework.registry import PARALLELISM

DP_BALANCE = ("round_robin", "shortest_queue")


@dataclass
class DPAttnConfig(ParallelConfig):
    name: str = "dp_attn"
    schedule_conservativeness: float = 0.3


@PARALLELISM.register("dp_attn")
class DPAttention(Parallelism):
    Config = DPAttnConfig
    replicates_batch = False

    @classmethod
    def check_fits(cls, model_cfg, size: int, moe_partial: bool) -> list[str]:
        return ffn_shard_problems(model_cfg, size, moe_partial)

    def shard(self, model) -> None:
        shard_ffns(model, self.rank, self.size)   # attention stays whole on every rank

    def ffn(self, h, module, batch):
        if self.size == 1 or module.token_layout == "local":
            return module(h)                      # "local": the backend moves tokens itself (an IDLE rank passes 0)
        counts = batch.global_num_tokens
        out = module(self.group.all_gather_uneven(h, counts))
        if module.partial:
            return self.group.reduce_scatter_uneven(out, counts)
        start = sum(counts[: self.rank])
        return out[start:start + counts[self.rank]]

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
