"""What the MoE backend tests run inside each rank (module level, so spawned ranks import it by name).

Every rank rebuilds the same layer weights and the same step's tokens from a seed, runs each backend under the token
layout contract the parallelism plugins implement (below), and compares its rows with `experts_reference` on all of
the step's tokens. One launch runs every (scenario, parallel style, backend) combination, because spawning costs
seconds and the machine has two cores.
"""
from __future__ import annotations

import torch

from framework.dist import Group
from framework.model.gating import select_experts
from framework.model.reference import experts_reference
from plugins.moe.reference import ReferenceConfig as MoEConfig   # moe=reference
from framework.core.registry import MOE
from plugins.moe.ep import EPConfig, EPLBConfig
from plugins.moe.triton_fused import TritonFusedConfig

H, I, E = 32, 16, 8
BACKENDS = {
    "reference": MoEConfig(),
    "triton_fused": TritonFusedConfig(),
    "triton_fused[triton]": TritonFusedConfig(kernel="triton"),   # the Triton kernel itself (interpreted on CPU)
    "ep_all_to_all": EPConfig(),
    "ep_all_to_all[triton]": EPConfig(kernel="triton"),
    "ep_all_reduce": EPConfig(dispatch="all_reduce"),
    # expert placement: replicas anywhere, least-loaded dispatch; EPLB moving weights before every forward; TBO
    "ep_replicas[shuffled]": EPConfig(num_redundant_experts=4, placement="shuffled", placement_seed=1),
    "ep_all_reduce_replicas[shuffled]": EPConfig(dispatch="all_reduce", num_redundant_experts=2,
                                                 placement="shuffled", placement_seed=2),
    "ep_eplb[every_forward]": EPConfig(num_redundant_experts=4, eplb=EPLBConfig(rebalance_every=1)),
    "ep_tbo": EPConfig(tbo=True),
    "ep_tbo[decode_lag,replicas]": EPConfig(tbo=True, tbo_delta_stages=2, num_redundant_experts=2,
                                            placement="shuffled", placement_seed=3),
}
# Scenario -> (tokens each rank holds under DP attention at size 1 / size 2, top_k, how the experts are picked).
SCENARIOS = {
    "uneven_loads": ({1: [9], 2: [5, 4]}, 2, "skewed"),
    "all_on_rank0_experts": ({1: [7], 2: [3, 4]}, 2, "low_half"),
    "all_on_rank1_experts": ({1: [7], 2: [4, 3]}, 2, "high_half"),
    "rank_with_zero_tokens": ({1: [6], 2: [6, 0]}, 2, "skewed"),
    "single_token": ({1: [1], 2: [0, 1]}, 2, "uniform"),   # under TP's split one rank gets nothing either
    "top1": ({1: [8], 2: [2, 6]}, 1, "uniform"),
    "router_v2": ({1: [10], 2: [6, 4]}, 2, "v2"),
    "router_v3": ({1: [10], 2: [4, 6]}, 3, "v3"),
}
STYLES = ("dp_attn", "tp")


def layer_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5


def _pick_experts(total: int, top_k: int, how: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[total, top_k] distinct expert ids per token and their weights."""
    if how in ("v2", "v3"):
        logits = torch.randn(total, E, generator=gen)
        bias = torch.randn(E, generator=gen) * 0.5 if how == "v3" else None
        return select_experts(logits, top_k=top_k, n_group=4, topk_group=2, gating=how, routed_scaling_factor=2.5,
                              norm_topk_prob=how == "v3", correction_bias=bias)
    # Gumbel top-k on log-probabilities: distinct ids drawn in proportion to `prob`.
    prob = {"uniform": torch.ones(E), "skewed": torch.tensor([40., 12, 6, 3, 1, 0, 0, 1]),
            "low_half": torch.tensor([1.] * (E // 2) + [0.] * (E // 2)),
            "high_half": torch.tensor([0.] * (E // 2) + [1.] * (E // 2))}[how]
    gumbel = -torch.log(-torch.log(torch.rand(total, E, generator=gen).clamp_min(1e-9)))
    ids = (prob.log() + gumbel).topk(top_k, dim=-1).indices
    return ids, torch.rand(total, top_k, generator=gen) + 0.1


def step_inputs(name: str, size: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens per rank, hidden [T, H], topk_ids [T, k], topk_weights [T, k]) of the whole step."""
    per_size, top_k, how = SCENARIOS[name]
    counts = per_size[size]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))   # str hash() differs per process
    hidden = torch.randn(sum(counts), H, generator=gen)
    ids, weights = _pick_experts(sum(counts), top_k, how, gen)
    return counts, hidden, ids, weights


def even_split(n: int, size: int) -> list[int]:
    return [n // size + (r < n % size) for r in range(size)]


def forward_under_contract(backend, group: Group, style: str, counts, hidden, ids, weights):
    """What the parallelism plugins do around the backend. Returns (rows this rank ends up with, their slice)."""
    rank = group.rank
    if style == "dp_attn":   # each rank holds its own tokens
        own = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
        if backend.token_layout == "local":
            return backend.forward(hidden[own], ids[own], weights[own]), own
        got = group.all_gather_counts(own.stop - own.start)
        gathered = [group.all_gather_uneven(t[own], got) for t in (hidden, ids, weights)]
        out = backend.forward(*gathered)
        return (group.reduce_scatter_uneven(out, got) if backend.partial else out[own]), own
    everything = slice(0, hidden.shape[0])   # tp: every rank holds every token
    if backend.token_layout == "all":
        out = backend.forward(hidden, ids, weights)
        return (group.all_reduce(out) if backend.partial else out), everything
    split = even_split(hidden.shape[0], group.size)
    mine = slice(sum(split[:rank]), sum(split[:rank + 1]))
    return group.all_gather_uneven(backend.forward(hidden[mine], ids[mine], weights[mine]), split), everything


def run_all_cases(group: Group) -> dict:
    """Max abs error of every (scenario, style, backend) against experts_reference, plus facts the test checks."""
    torch.set_num_threads(1)
    w13, w2 = layer_weights()
    backends = {key: MOE.build(cfg.name, cfg, w13, w2, group) for key, cfg in BACKENDS.items()}
    errors, reference_norms = {}, {}
    for name in SCENARIOS:
        counts, hidden, ids, weights = step_inputs(name, group.size)
        expected = experts_reference(hidden, w13, w2, ids, weights)
        reference_norms[name] = float(expected.norm())
        for style in STYLES:
            for key, backend in backends.items():
                out, rows = forward_under_contract(backend, group, style, counts, hidden, ids, weights)
                assert out.shape == expected[rows].shape, (name, style, key, tuple(out.shape))
                errors[f"{name}/{style}/{key}"] = (out - expected[rows]).abs().max().item() if out.numel() else 0.0
    layouts = {key: (b.token_layout, b.partial, tuple(b.w13.shape), tuple(b.w2.shape)) for key, b in backends.items()}
    placed = backends["ep_eplb[every_forward]"]
    return {"errors": errors, "reference_norms": reference_norms, "layouts": layouts,
            "eplb": {**placed.stats, "forwards": placed.forwards, "phy2log": placed.placement.phy2log},
            "bad_expert_count": _construction_error(group), "load_stats": load_stats_case(group)}


def _construction_error(group: Group) -> str:
    """The message ep gives when the expert count does not divide by the instance size ("" when it does)."""
    w13, w2 = layer_weights()
    try:
        MOE.build("ep", EPConfig(), w13[:7], w2[:7], group)
    except ValueError as exc:
        return str(exc)
    return ""


STATS_TOKENS = [5, 3]   # rows per rank in load_stats_case (size 2); size 1 takes them all


def stats_tokens(model_cfg, size: int) -> list[torch.Tensor]:
    """Each rank's hidden rows for load_stats_case."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(sum(STATS_TOKENS), model_cfg.hidden_size, generator=gen)
    return [rows] if size == 1 else list(rows.split(STATS_TOKENS))


def load_stats_case(group: Group) -> dict:
    """expert_load_stats after one DP-attention-style step, for a layout-"local" backend (each rank routes its own
    tokens: the counts are summed across ranks) and a layout-"all" one (each rank routes every token)."""
    from framework.model.config import ModelConfig
    from framework.model.model import build_model
    from framework.model.moe_stats import expert_load_stats

    model_cfg = ModelConfig()
    out = {}
    for key in ("ep_all_to_all", "triton_fused"):
        model = build_model(model_cfg, seed=0)
        for layer in model.moe_layers():
            layer.backend = MOE.build(BACKENDS[key].name, BACKENDS[key], layer.w13, layer.w2, group)
        every_rank = stats_tokens(model_cfg, group.size)
        x = every_rank[group.rank] if model.moe_layers()[0].token_layout == "local" else torch.cat(every_rank)
        for layer in model.moe_layers():
            layer(x)
        out[key] = expert_load_stats(model, group)
    return out
