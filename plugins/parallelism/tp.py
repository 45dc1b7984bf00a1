"""parallel=tp: tensor-parallel attention (heads split across ranks), vocabulary-parallel embedding and lm_head,
tensor-parallel dense FFN: SGLang v0.4's default for DeepSeek models.

Every rank runs the same batch. Each keeps num_heads/size heads (their rows of q_b and kv_b, so the absorbed
up-projections W_UK/W_UV are per head too) and the matching columns of o, whose partial outputs one all-reduce sums;
q_a and kv_a are per token, not per head, and stay whole (SGLang's ReplicatedLinear). The embedding and the lm_head
keep a contiguous slice of the vocabulary each (VocabParallelEmbedding, ParallelLMHead): a lookup sums the ranks'
rows (all-reduce), the logits gather the ranks' columns (all-gather).

The MLA latent is one vector per token shared by all heads, so it cannot be split by heads: every rank stores the
whole latent of every token, and KV bytes per token per rank stay the full latent size (the waste DP attention fixes).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from framework.contracts.parallel import (Collective, Parallelism, ParallelConfig, even_split, ffn_shard_problems,
                                model_weight_bytes, shard_ffns)
from framework.core.registry import PARALLELISM
from plugins.parallelism.lib.phase import tell_phase


@dataclass
class TPConfig(ParallelConfig):
    name: str = "tp"
    size: int = 2


@PARALLELISM.register("tp")
class TensorParallel(Parallelism):
    Config = TPConfig

    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        problems = []
        if model_cfg.num_heads % cfg.size:
            problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.size={cfg.size} "
                            "(parallel=tp gives each rank an equal share of the attention heads)")
        return problems + ffn_shard_problems(model_cfg, cfg.size, moe_partial)

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, moe_partial: bool) -> dict[str, int]:
        return model_weight_bytes(model_cfg, heads=model_cfg.num_heads // cfg.size,
                                  vocab_rows=even_split(model_cfg.vocab_size, cfg.size)[rank],
                                  ffn_shards=cfg.size, shared_sharded=moe_partial)

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens, ffn_layout, ffn_partial):
        if cfg.size == 1:
            return []
        ranks, row = tuple(range(cfg.size)), model_cfg.hidden_size * model_cfg.itemsize
        out = [Collective("all_reduce", tokens[0] * row, ranks)]                   # attention: partial per head
        if ffn_layout == "local":                                                  # each rank ran a share of tokens
            out.append(Collective("all_gather", cfg.size * max(even_split(tokens[0], cfg.size)) * row, ranks))
        elif ffn_partial:
            out.append(Collective("all_reduce", tokens[0] * row, ranks))
        return out

    @classmethod
    def edge_comm(cls, cfg, model_cfg, tokens, logit_rows):
        if cfg.size == 1:
            return []
        ranks, size = tuple(range(cfg.size)), model_cfg.itemsize
        vocab = cfg.size * max(even_split(model_cfg.vocab_size, cfg.size))
        return [Collective("all_reduce", tokens[0] * model_cfg.hidden_size * size, ranks),   # embedding rows
                Collective("all_gather", logit_rows[0] * vocab * size, ranks)]               # logits columns

    def shard(self, model) -> None:
        if self.size > 1:
            for block in model.layers:
                block.attn.shard_heads(self.rank, self.size)
            rows = even_split(model.cfg.vocab_size, self.size)
            self.vocab_counts, self.vocab_start = rows, sum(rows[: self.rank])
            cut = slice(self.vocab_start, self.vocab_start + rows[self.rank])
            model.embed = nn.Parameter(model.embed.data[cut].clone())
            model.lm_head = nn.Parameter(model.lm_head.data[cut].clone())
        shard_ffns(model, self.rank, self.size)

    def embed(self, table, ids):
        if self.size == 1:
            return table[ids]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < table.shape[0])
        rows = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)
        return self.group.all_reduce(rows, "sum")

    def logits(self, x, lm_head):
        if self.size == 1:
            return x @ lm_head.t()
        columns = (x @ lm_head.t()).t().contiguous()                   # [vocab slice, rows]
        return self.group.all_gather_uneven(columns, self.vocab_counts).t()

    def attn_reduce(self, x):
        return self.group.all_reduce(x, "sum") if self.size > 1 else x

    def ffn(self, h, module, batch):
        tell_phase(module, batch.mode.is_decode())   # one batch on every rank
        if self.size == 1:
            return module(h)
        if module.token_layout == "local":
            # every rank holds the same tokens: each runs its share through the backend, then all share the result
            counts = even_split(h.shape[0], self.size)
            start = sum(counts[: self.rank])
            return self.group.all_gather_uneven(module(h[start:start + counts[self.rank]]), counts)
        out = module(h)
        return self.group.all_reduce(out, "sum") if module.partial else out
