"""parallel=tp: tensor-parallel attention (heads split across ranks) and tensor-parallel dense FFN.

Every rank runs the same batch. Each keeps num_heads/size heads (their rows of q_b and kv_b, so the absorbed
up-projections W_UK/W_UV are per head too) and the matching columns of o, whose partial outputs one all-reduce sums.
The MLA latent is one vector per token shared by all heads, so it cannot be split by heads: every rank stores the
whole latent of every token, and KV bytes per token per rank stay the full latent size (the waste DP attention fixes).
"""
from __future__ import annotations

from framework.parallel import Parallelism, ParallelConfig, ffn_shard_problems, shard_ffns
from framework.registry import PARALLELISM


def even_split(n: int, size: int) -> list[int]:
    """n rows over `size` ranks, the first n % size ranks one more."""
    return [n // size + (r < n % size) for r in range(size)]


@PARALLELISM.register("tp")
class TensorParallel(Parallelism):
    Config = ParallelConfig
    replicates_batch = True

    @classmethod
    def check_fits(cls, model_cfg, size: int, moe_partial: bool) -> list[str]:
        problems = []
        if model_cfg.num_heads % size:
            problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.size={size} "
                            "(parallel=tp gives each rank an equal share of the attention heads)")
        return problems + ffn_shard_problems(model_cfg, size, moe_partial)

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
        if module.token_layout == "local":
            # every rank holds the same tokens: each runs its share through the backend, then all share the result
            counts = even_split(h.shape[0], self.size)
            start = sum(counts[: self.rank])
            return self.group.all_gather_uneven(module(h[start:start + counts[self.rank]]), counts)
        out = module(h)
        return self.group.all_reduce(out, "sum") if module.partial else out
