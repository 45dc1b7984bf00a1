"""parallel=dp_attn_tp: DP attention with tensor parallelism inside each DP group (SGLang shipped this after v0.4:
`--enable-dp-attention` with dp_size < tp_size).

`parallel.size` ranks form size / tp_size DP groups of `tp_size` consecutive ranks. Inside a group the ranks run one
batch, one scheduler's decisions on each (the same requests, KV and radix cache: the latent KV is replicated within
the group, as under TP) and split the attention heads, whose partial outputs an all-reduce over the group sums. The
embedding and lm_head stay whole (as under DP attention). The FFN / MoE layers span every rank: each rank of a group
hands 1/tp_size of the group's tokens to DP attention's FFN exchange (`parallel.ffn_comm`), and the group all-gathers
the shares back afterwards. With tp_size=1 this is dp_attn; with tp_size=size, one TP group whose FFN sees each token
once.
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.dist.group import Group
from framework.contracts.parallel import Collective, even_split, ffn_shard_problems, model_weight_bytes, shard_ffns
from framework.core.registry import PARALLELISM
from plugins.parallelism.dp_attn import DPAttention, DPAttnConfig, FFNComm, ffn_comm
from plugins.parallelism.lib.phase import tell_phase


@dataclass
class DPAttnTPConfig(DPAttnConfig):
    name: str = "dp_attn_tp"
    size: int = 4
    tp_size: int = 2          # ranks per DP group: the attention heads are split tp_size ways inside it


@PARALLELISM.register("dp_attn_tp")
class DPAttentionTP(DPAttention):
    Config = DPAttnTPConfig

    def __init__(self, cfg: DPAttnTPConfig, group, control=None) -> None:
        super().__init__(cfg, group, control)
        self.tp = cfg.tp_size
        self.tp_rank = self.rank % self.tp
        self.first = self.rank - self.tp_rank              # the group's first rank
        self.attn_group = attention_group(group, self.tp)

    @classmethod
    def dp_size(cls, cfg) -> int:
        return cfg.size // cfg.tp_size

    @classmethod
    def dp_rank_of(cls, cfg, rank: int) -> int:
        return rank // cfg.tp_size

    @classmethod
    def describe(cls, cfg) -> dict:
        return {**super().describe(cfg), "tp_size": cfg.tp_size}

    def set_step(self, step: int) -> None:
        super().set_step(step)
        self.attn_group.step = step

    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        if cfg.tp_size < 1 or cfg.size % cfg.tp_size:
            return [f"parallel.tp_size={cfg.tp_size} must divide parallel.size={cfg.size} (ranks per DP group)"]
        problems = []
        if model_cfg.num_heads % cfg.tp_size:
            problems.append(f"model.num_heads={model_cfg.num_heads} is not divisible by parallel.tp_size="
                            f"{cfg.tp_size} (each rank of a DP group keeps an equal share of the heads)")
        return problems + ffn_shard_problems(model_cfg, cfg.size, moe_partial)

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, moe_partial: bool) -> dict[str, int]:
        return model_weight_bytes(model_cfg, heads=model_cfg.num_heads // cfg.tp_size,
                                  vocab_rows=model_cfg.vocab_size, ffn_shards=cfg.size, shared_sharded=moe_partial)

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens, ffn_layout, ffn_partial):
        if cfg.size == 1:
            return []
        tp, row = cfg.tp_size, model_cfg.hidden_size * model_cfg.itemsize
        groups = [tuple(range(g, g + tp)) for g in range(0, cfg.size, tp)]
        busy = [g for g in groups if tp > 1 and tokens[g[0]]]            # an IDLE group skips attention
        out = [Collective("all_reduce", tokens[g[0]] * row, g) for g in busy]
        shares = ffn_shares(tokens, tp)
        if ffn_layout != "local":
            out += ffn_comm(cfg, shares, row, ffn_partial)
        if ffn_layout == "local" or (ffn_partial and cfg.ffn_comm is FFNComm.reduce_scatter):   # shares come back
            out += [Collective("all_gather", tp * max(shares[g[0]:g[-1] + 1]) * row, g) for g in busy]
        return out

    def shard(self, model) -> None:
        if self.tp > 1:
            for block in model.layers:
                block.attn.shard_heads(self.tp_rank, self.tp)
        shard_ffns(model, self.rank, self.size)

    def attn_reduce(self, x):
        return self.attn_group.all_reduce(x, "sum") if self.tp > 1 else x

    def ffn(self, h, module, batch):
        tell_phase(module, batch.can_run_graph)
        if self.size == 1:
            return module(h)
        shares = ffn_shares(batch.global_num_tokens, self.tp)
        mine = shares[self.first:self.first + self.tp]
        start = sum(mine[: self.tp_rank])
        share = h[start:start + mine[self.tp_rank]]
        if module.token_layout == "local":
            return self.attn_group.all_gather_uneven(module(share), mine)
        if not module.partial or self.cfg.ffn_comm is not FFNComm.reduce_scatter:
            # every rank gets complete rows of every token: keep the group's, no exchange inside the group
            out = module(self.group.all_gather_uneven(share, shares))
            if module.partial:
                out = self.group.all_reduce(out, "sum")
            begin = sum(shares[: self.first])
            return out[begin:begin + h.shape[0]]
        return self.attn_group.all_gather_uneven(self.ffn_over(share, module, shares), mine)


def ffn_shares(tokens: list[int], tp: int) -> list[int]:
    """Rows each rank hands to the FFN: rank r of a group holding T tokens takes even_split(T, tp)[r % tp]."""
    return [even_split(n, tp)[r % tp] for r, n in enumerate(tokens)]


_GROUPS: dict[tuple, Group] = {}


def attention_group(group: Group, tp: int) -> Group:
    """This rank's attention-TP group (tp consecutive ranks). Made once per instance: every rank creates every
    group, in the same order, as torch.distributed requires."""
    if tp == 1:
        return Group()
    key = (id(group.pg), tp)
    if key not in _GROUPS:
        import torch.distributed as dist
        ranks = [[dist.get_global_rank(group.pg, r) for r in range(g, g + tp)] for g in range(0, group.size, tp)]
        mine, _ = dist.new_subgroups_by_enumeration(ranks, backend=group.backend)
        _GROUPS[key] = Group(group.rank % tp, tp, group.backend, group.device, group.timeout_s, pg=mine)
    return _GROUPS[key]
