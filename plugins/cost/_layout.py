"""How an instance's ranks share a step's work and what they communicate, read from the plugins' own declarations
through the registry (no plugin is named here): a new parallelism or MoE plugin brings its cost with it.

- compute split: the parallelism plugin's `dp_size` (schedulers; `size // dp_size` ranks split one batch's heads
  and vocabulary), the MoE backend's `layout` (which tokens it takes, whether its output is a partial sum) and
  `expert_split` (whole experts per rank vs intermediate slices);
- communication: the parallelism plugin's `layer_comm` (per dense and per MoE layer) and `edge_comm` (embedding,
  logits), the MoE backend's own `layer_comm` (e.g. ep's all-to-all), for the step's tokens on each rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.parallel import even_split
from framework.core.registry import MOE, PARALLELISM
from framework.contracts.cost import Collective, InstanceShape


@dataclass(frozen=True)
class Layout:
    size: int              # ranks of the instance
    attn_tp: int           # ranks that split one batch's attention heads and vocabulary (one scheduler per group)
    moe_tokens: str        # all: each rank's MoE backend sees every token of the instance; local: only its own
    moe_partial: bool      # the MoE output is a partial sum reduced across ranks (shared experts sliced alike)
    expert_split: int      # ranks the routed experts are divided over, whole experts each
    inter_split: int       # ranks every routed expert's intermediate dim is sliced over

    @property
    def groups(self) -> int:
        return self.size // self.attn_tp


def plugin_configs(inst: InstanceShape) -> tuple:
    """(parallelism class, its config, MoE class, its config): the instance's own, else each plugin's defaults
    (the parallelism's at the instance's size)."""
    par_cls, moe_cls = PARALLELISM.get(inst.parallel), MOE.get(inst.moe)
    par_cfg = inst.parallel_cfg if inst.parallel_cfg is not None else par_cls.Config(size=inst.size)
    moe_cfg = inst.moe_cfg if inst.moe_cfg is not None else moe_cls.Config()
    return par_cls, par_cfg, moe_cls, moe_cfg


def layout_for(inst: InstanceShape) -> Layout:
    par_cls, par_cfg, moe_cls, moe_cfg = plugin_configs(inst)
    n, groups = inst.size, par_cls.dp_size(par_cfg)
    if groups < 1 or n % groups:
        raise ValueError(f"parallel={inst.parallel} declares {groups} schedulers on {n} ranks: they must divide it")
    moe_tokens, moe_partial = moe_cls.layout(moe_cfg, n)
    return Layout(n, n // groups, moe_tokens, moe_partial, *moe_cls.expert_split(moe_cfg, n))


def declared_collectives(inst: InstanceShape, lay: Layout, group_tokens: tuple[int, ...],
                         group_reqs: tuple[int, ...], moe_comm: bool = True,
                         dense_comm: bool = True) -> tuple[Collective, ...]:
    """A step's collectives as the plugins declare them, when scheduler g runs group_tokens[g] tokens of
    group_reqs[g] requests, each layer's times the layers of its kind. Collectives over every rank run one after
    another; those of DP groups over their own ranks run side by side: the group that moves the most sets the pace.
    `moe_comm` False: without the MoE backend's own (the cost model prices them: DeepEP, two-batch overlap);
    `dense_comm` False: without the dense layers' (each rank runs them on its own tokens)."""
    par_cls, par_cfg, moe_cls, moe_cfg = plugin_configs(inst)
    m = inst.model
    tokens = [t for t in group_tokens for _ in range(lay.attn_tp)]          # rank r runs its group's batch
    logit_rows = [r for r in group_reqs for _ in range(lay.attn_tp)]
    # what a "local" backend is passed: its rank's batch, or under TP (one batch) each rank's share of it
    local = even_split(tokens[0], lay.size) if lay.groups == 1 else tokens
    moe_layers = m.num_layers - m.first_k_dense_replace
    per_layer = [(par_cls.edge_comm(par_cfg, m, tokens, logit_rows), 1),
                 (par_cls.layer_comm(par_cfg, m, tokens, "all", lay.size > 1) if dense_comm else [],
                  m.first_k_dense_replace),
                 (par_cls.layer_comm(par_cfg, m, tokens, lay.moe_tokens, lay.moe_partial)
                  + (moe_cls.layer_comm(moe_cfg, m, local if lay.moe_tokens == "local" else tokens) if moe_comm
                     else []), moe_layers)]
    everyone = tuple(range(lay.size))
    out: dict[tuple[str, int, int], int] = {}
    for collectives, count in per_layer:
        groups: dict[tuple, list] = {}
        for c in collectives:
            groups.setdefault(tuple(c.ranks), []).append(c)
        paced = groups.pop(everyone, [])
        if groups:
            paced += max(groups.values(), key=lambda cs: sum(c.bytes for c in cs))
        for c in paced:
            key = (c.kind, c.bytes, len(c.ranks))
            out[key] = out.get(key, 0) + count
    return tuple(Collective(kind, nbytes, ranks, count) for (kind, nbytes, ranks), count in out.items() if count)
