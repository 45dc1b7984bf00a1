"""How an instance's ranks share a step's work, and the collectives SGLang v0.4 makes for it.

FALLBACK: this module names parallelism and MoE plugins, which a cost model should not need to do. Each plugin will
declare its own per-layer collectives (and its compute split) and the simulator will pass those in `Step.collectives`;
until then the roofline derives both here, for parallel=tp|dp_attn|dp_attn_tp x moe=reference|triton_fused|ep.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb

from framework.sim.cost import Collective, Instance, itemsize

ROUTING_BYTES = 8          # per (token, expert) pair sent with a token under all-to-all: int32 id + fp32 weight


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


def layout_for(inst: Instance) -> Layout:
    n = inst.size
    attn_tp = {"single": 1, "tp": n, "dp_attn": 1, "dp_attn_tp": inst.tp_size}.get(inst.parallel)
    if attn_tp is None:
        raise ValueError(f"the roofline cost model has no fallback layout for parallel={inst.parallel!r} "
                         "(known: single, tp, dp_attn, dp_attn_tp); the plugin must declare its compute split")
    if attn_tp < 1 or n % attn_tp:
        raise ValueError(f"parallel.tp_size={attn_tp} must divide parallel.size={n}")
    if inst.moe == "reference":
        moe = ("all", False, 1, 1)
    elif inst.moe == "triton_fused":
        moe = ("all", n > 1, 1, n)
    elif inst.moe == "ep" and inst.dispatch in ("all_to_all", "all_reduce"):
        moe = ("local", False, n, 1) if inst.dispatch == "all_to_all" else ("all", n > 1, n, 1)
    else:
        raise ValueError(f"the roofline cost model has no fallback layout for moe={inst.moe!r} "
                         f"dispatch={inst.dispatch!r} (known: reference, triton_fused, ep with all_to_all|all_reduce)")
    return Layout(n, attn_tp, *moe)


def expected_destinations(ranks: int, top_k: int, experts: int) -> float:
    """Ranks a token's top-k (distinct) experts live on, in expectation under uniform routing with whole experts
    split evenly: a rank holds none of them with probability C(E - E/n, k) / C(E, k)."""
    return ranks * (1.0 - comb(experts - experts // ranks, top_k) / comb(experts, top_k))


def collectives_for(inst: Instance, layout: Layout, t_max: int, reqs: int) -> tuple[Collective, ...]:
    """SGLang v0.4's collectives for one step. TP: vocab-parallel embedding, one all-reduce after each attention
    and each FFN, the logits gathered. DP attention: before each FFN an all-gather padded to the largest rank's
    tokens, the FFN's own all-reduce of partial sums, then each rank keeps its rows. EP all-to-all: the token
    dispatch and combine (plus the count exchange) per MoE layer, no gather. `t_max`: tokens of the step's largest
    batch; `reqs`: requests of the batch with the most (their logits are gathered)."""
    m, n, lay = inst.model, layout.size, layout
    if n == 1:
        return ()
    act = itemsize(m.dtype)
    row = m.hidden_size * act
    moe_layers = m.num_layers - m.first_k_dense_replace
    out: list[Collective] = []
    if lay.attn_tp > 1:
        out += [Collective("all_reduce", t_max * row, lay.attn_tp, 1),               # vocab-parallel embedding
                Collective("all_reduce", t_max * row, lay.attn_tp, m.num_layers),    # attention output
                Collective("all_gather", reqs * m.vocab_size * act, lay.attn_tp, 1)]   # logits
    gathered = lay.groups * t_max * row            # padded to the largest group's tokens
    ffn_comm = ([Collective("all_gather", gathered, n, 1)] if lay.groups > 1 else []) + \
        [Collective("all_reduce", gathered, n, 1)]
    out += [Collective(c.kind, c.nbytes, c.ranks, m.first_k_dense_replace) for c in ffn_comm]   # dense FFNs
    if lay.moe_tokens == "all":            # like a dense FFN, less the all-reduce when the output is whole
        moe_comm = ffn_comm if lay.moe_partial else [c for c in ffn_comm if c.kind == "all_gather"]
        return tuple(out + [Collective(c.kind, c.nbytes, c.ranks, moe_layers) for c in moe_comm])
    local = t_max if lay.groups > 1 else -(-t_max // n)      # TP: each rank sends its share of the batch
    rows = local * expected_destinations(n, m.num_experts_per_tok, m.n_routed_experts)
    out += [Collective("all_to_all", 8 * n, n, moe_layers),                                   # counts
            Collective("all_to_all", round(rows * (row + ROUTING_BYTES * m.num_experts_per_tok)), n, moe_layers),
            Collective("all_to_all", round(rows * row), n, moe_layers)]                     # combine
    if lay.groups == 1:
        out.append(Collective("all_gather", t_max * row, n, moe_layers))   # TP: every rank needs every output
    return tuple(out)
