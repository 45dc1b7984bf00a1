"""parallel=tp_replicated_vocab: tensor-parallel attention and FFN like the built-in tp, but the embedding and the
lm_head stay whole on every rank. Each rank spends vocab x hidden more weight bytes, and in return a step makes no
embedding all-reduce and no logits all-gather: each rank looks up its own rows and computes every logit itself.

verify checks the scheme's own protocol too (`check_step_logs`): every rank ran steps, and all ran the same ones
(one DP group: the same batch, mode and tokens at every step)."""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.parallel import (Collective, Parallelism, ParallelConfig, even_split, ffn_shard_problems,
                                          model_weight_bytes, shard_ffns)
from framework.core.registry import PARALLELISM


@dataclass
class ReplicatedVocabConfig(ParallelConfig):
    name: str = "tp_replicated_vocab"
    size: int = 2


@PARALLELISM.register("tp_replicated_vocab")
class ReplicatedVocabTP(Parallelism):
    Config = ReplicatedVocabConfig

    @classmethod
    def describe(cls, cfg) -> dict:
        return {**super().describe(cfg), "vocab": "replicated"}

    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        problems = []
        if model_cfg.num_heads % cfg.size:
            problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.size={cfg.size}")
        return problems + ffn_shard_problems(model_cfg, cfg.size, moe_partial)

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, moe_partial: bool) -> dict[str, int]:
        return model_weight_bytes(model_cfg, heads=model_cfg.num_heads // cfg.size, vocab_rows=model_cfg.vocab_size,
                                  ffn_shards=cfg.size, shared_sharded=moe_partial)

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens, ffn_layout, ffn_partial):
        if cfg.size == 1:
            return []
        ranks, row = tuple(range(cfg.size)), model_cfg.hidden_size * model_cfg.itemsize
        out = [Collective("all_reduce", tokens[0] * row, ranks)]           # attention: a partial sum per head
        if ffn_layout == "local":
            out.append(Collective("all_gather", cfg.size * max(even_split(tokens[0], cfg.size)) * row, ranks))
        elif ffn_partial:
            out.append(Collective("all_reduce", tokens[0] * row, ranks))
        return out

    @classmethod
    def check_step_logs(cls, logs: list[list]) -> list[str]:
        if not all(logs):
            return [f"steps logged per rank: {[len(log) for log in logs]}; every rank runs every step"]
        if any(log != logs[0] for log in logs):
            return ["the ranks did not run the same steps in lockstep"]
        return []

    def shard(self, model) -> None:
        if self.size > 1:
            for block in model.layers:
                block.attn.shard_heads(self.rank, self.size)
        shard_ffns(model, self.rank, self.size)

    def attn_reduce(self, x):
        return self.group.all_reduce(x, "sum") if self.size > 1 else x

    def ffn(self, h, module, batch):
        if self.size == 1:
            return module(h)
        if module.token_layout == "local":       # every rank holds the same tokens: each runs a share, then all
            counts = even_split(h.shape[0], self.size)
            start = sum(counts[: self.rank])
            return self.group.all_gather_uneven(module(h[start:start + counts[self.rank]]), counts)
        out = module(h)
        return self.group.all_reduce(out, "sum") if module.partial else out
