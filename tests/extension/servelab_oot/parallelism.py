"""parallel=tp_replicated_vocab: tensor-parallel attention and FFN like the built-in tp, but the embedding and the
lm_head stay whole on every rank. Each rank spends vocab x hidden more weight bytes, and in return a step makes no
embedding all-reduce and no logits all-gather: each rank looks up its own rows and computes every logit itself.

verify checks the scheme's own protocol too (`check_step_logs`): every rank ran steps, and all ran the same ones
(one DP group: the same batch, mode and tokens at every step)."""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.parallel import Parallelism, ParallelConfig, model_weight_bytes, shard_ffns
from framework.core.registry import PARALLELISM

TensorParallel = PARALLELISM.get("tp")     # a third party builds on a built-in through the registry, by its key


@dataclass
class ReplicatedVocabConfig(ParallelConfig):
    name: str = "tp_replicated_vocab"
    size: int = 2


@PARALLELISM.register("tp_replicated_vocab")
class ReplicatedVocabTP(TensorParallel):
    """The built-in tp's heads and FFN split; the vocabulary's hooks are the contract's own (whole on every rank)."""
    Config = ReplicatedVocabConfig
    edge_comm = classmethod(Parallelism.edge_comm.__func__)
    embed, logits = Parallelism.embed, Parallelism.logits

    @classmethod
    def describe(cls, cfg) -> dict:
        return {**super().describe(cfg), "vocab": "replicated"}

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, moe_partial: bool) -> dict[str, int]:
        return model_weight_bytes(model_cfg, heads=model_cfg.num_heads // cfg.size, vocab_rows=model_cfg.vocab_size,
                                  ffn_shards=cfg.size, shared_sharded=moe_partial)

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
