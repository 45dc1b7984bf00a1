"""Expert-load statistics: the MoE layer's counts against a bincount of the router's choices, the imbalance
arithmetic, and the instance-wide sum across ranks for a layout-"local" backend (size 2 on gloo)."""
from __future__ import annotations

import pytest
import torch

from framework.dist import Group
from framework.model.config import ModelConfig
from framework.model.model import build_model
from framework.model.moe_stats import expert_load_stats
from framework.core.registry import MOE
from moe_helpers import reset_expert_load
from moe_rank_fns import BACKENDS, STATS_TOKENS, load_stats_case, stats_tokens


def expected_counts(model_cfg) -> dict[int, list[int]]:
    """Slots per expert per layer when every stats token of the step is routed once."""
    model = build_model(model_cfg, seed=0)
    x = torch.cat(stats_tokens(model_cfg, 1))
    first = model_cfg.first_k_dense_replace
    return {first + n: torch.bincount(layer.route(x)[0].flatten(), minlength=model_cfg.n_routed_experts).tolist()
            for n, layer in enumerate(model.moe_layers())}


def check_stats(stats: dict, model_cfg, size: int) -> None:
    want = expected_counts(model_cfg)
    assert stats["expert_load"] == {f"layer{i}": c for i, c in want.items()}
    top_k, tokens = model_cfg.num_experts_per_tok, sum(STATS_TOKENS)
    for i, counts in want.items():
        assert stats[f"moe_layer{i}_routed_slots"] == tokens * top_k
        assert stats[f"moe_layer{i}_max_expert_slots"] == max(counts)
        assert stats[f"moe_layer{i}_expert_imbalance"] == pytest.approx(max(counts) / (tokens * top_k / len(counts)))
        if size > 1:
            half = len(counts) // 2
            per_rank = [sum(counts[:half]), sum(counts[half:])]
            assert stats[f"moe_layer{i}_ep_rank_imbalance"] == pytest.approx(max(per_rank) / (sum(per_rank) / 2))
    assert stats["expert_imbalance_max"] == max(stats[f"moe_layer{i}_expert_imbalance"] for i in want)


def test_counts_match_the_router_at_size_1():
    check_stats(load_stats_case(Group())["ep_all_to_all"], ModelConfig(), 1)


@pytest.mark.long
@pytest.mark.parametrize("key", ["ep_all_to_all", "triton_fused"])
def test_counts_are_instance_wide_at_size_2(size2_results, key):
    for res in size2_results:   # every rank reports the whole instance's counts
        check_stats(res["load_stats"][key], ModelConfig(), 2)


def test_reset_and_imbalance_extremes():
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    for layer in model.moe_layers():
        layer.backend = MOE.build("reference", BACKENDS["reference"], layer.w13, layer.w2, Group())
    empty = expert_load_stats(model)
    assert empty["expert_imbalance_max"] == 0.0 and empty["moe_layer1_routed_slots"] == 0
    layer = model.moe_layers()[0]
    layer.expert_counts[3] = 10       # every slot on one expert: max/mean = number of experts
    assert expert_load_stats(model)["moe_layer1_expert_imbalance"] == cfg.n_routed_experts
    layer.expert_counts.fill_(4)      # perfectly even
    assert expert_load_stats(model)["moe_layer1_expert_imbalance"] == 1.0
    reset_expert_load(model)
    assert expert_load_stats(model)["moe_layer1_routed_slots"] == 0
