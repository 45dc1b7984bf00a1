"""Expert placement (plugins/moe/lib), EPLB (framework/contracts/eplb.py), two-batch overlap's schedule
(plugins/moe/lib/tbo.py), and moe=ep re-placing its experts in one process. The size-2 oracle (replicas anywhere,
EPLB every forward, TBO against experts_reference on gloo) is tests/moe/test_moe_backends.py's; the whole model's,
test_moe_verify.py's."""
from __future__ import annotations

import pytest
import torch

from framework.core.registry import MOE
from framework.dist import Group
from framework.model.reference import experts_reference
from moe_rank_fns import E, H, layer_weights, step_inputs
from plugins.moe.ep import EPConfig, EPLBConfig, initial_placement
from plugins.moe.lib import tbo
from framework.contracts.eplb import balanced_packing, rebalance, replicate_experts
from plugins.moe.lib.placement import Placement, contiguous, physical_ids, shuffled

# deepseek-ai/EPLB's README example: 2 layers of 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs, and its output
README_WEIGHTS = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


@pytest.mark.parametrize("layer", [0, 1])
def test_hierarchical_placement_reproduces_eplbs_published_example(layer):
    assert rebalance(README_WEIGHTS[layer], 16, 4, 2, 8) == README_PHY2LOG[layer]


def test_balanced_packing_fills_every_pack_equally_and_evens_the_loads():
    weights = [9, 8, 7, 6, 5, 4, 3, 2]
    pack, rank = balanced_packing(weights, 2)
    assert sorted(pack) == [0] * 4 + [1] * 4
    assert sorted(zip(pack, rank)) == [(p, r) for p in range(2) for r in range(4)]
    loads = [sum(w for w, p in zip(weights, pack) if p == k) for k in range(2)]
    assert loads == [22, 22]
    with pytest.raises(ValueError, match="divide into 3 packs"):
        balanced_packing(weights, 3)


def test_replicas_go_to_the_expert_with_the_most_load_per_replica():
    phy2log, count = replicate_experts([100, 10, 40, 1], 7)
    assert count == [3, 1, 2, 1] and sorted(phy2log) == [0, 0, 0, 1, 2, 2, 3]


def test_the_global_policy_evens_a_skew_the_contiguous_blocks_leave():
    loads = [64.0, 32, 16, 8, 4, 2, 1, 1]
    before = contiguous(8, 8, 2).rank_loads(loads)
    after = Placement(tuple(rebalance(loads, 12, 1, 1, 2, "global")), 8, 2).rank_loads(loads)
    assert max(before) == 120 and max(after) < 70 and sum(after) == pytest.approx(sum(before))


def test_placements_must_hold_every_expert_and_divide_over_the_ranks():
    with pytest.raises(ValueError, match="do not divide over 2 ranks"):
        contiguous(8, 9, 2)
    with pytest.raises(ValueError, match=r"missing \[7\]"):
        Placement((0, 1, 2, 3, 4, 5, 6, 6), 8, 2)
    with pytest.raises(ValueError, match=r"n_routed_experts=8 \+ moe.num_redundant_experts=1\) across parallel.size=2"):
        initial_placement(EPConfig(num_redundant_experts=1), 8, 2)


def test_least_loaded_dispatch_spreads_an_experts_slots_evenly_over_its_replicas():
    p = Placement((0, 1, 2, 0, 3, 0), 4, 2)               # expert 0 has three replicas: slots 0, 3, 5
    log2phy, count = p.tables("cpu")
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])
    phys = physical_ids(ids, log2phy, count, start=1)
    assert [p.phy2log[s] for s in phys.view(-1).tolist()] == ids.view(-1).tolist()   # a replica of the expert
    assert sorted(phys[:, 0].tolist()) == [0, 0, 3, 3, 5, 5]                            # two slots each


def test_moves_fetch_only_what_a_rank_lacks_from_a_rank_that_has_it():
    old, new = contiguous(4, 4, 2), Placement((3, 1, 2, 0), 4, 2)
    assert old.moves(new) == [(3, 1, 0), (0, 0, 1)]
    assert old.moves(old) == []


def test_ep_on_one_rank_rebalances_from_its_loads_and_still_matches_the_reference():
    cfg = EPConfig(num_redundant_experts=4, placement="shuffled", eplb=EPLBConfig(rebalance_every=2))
    w13, w2 = layer_weights()
    backend = MOE.build("ep", cfg, w13, w2, Group())
    placements = []
    for name in ("uneven_loads", "router_v2", "router_v3", "all_on_rank0_experts"):
        _, hidden, ids, weights = step_inputs(name, 1)
        out = backend.forward(hidden, ids, weights)
        torch.testing.assert_close(out, experts_reference(hidden, w13, w2, ids, weights), atol=1e-4, rtol=0)
        placements.append(backend.placement.phy2log)
    assert backend.stats["eplb_rebalances"] == 1 and placements[1] != placements[2]
    assert backend.stats["eplb_experts_moved"] == 0      # one rank holds every expert: nothing travels


def test_shuffled_placement_is_the_same_on_every_rank_and_differs_from_the_blocks():
    assert shuffled(E, E + 4, 2, seed=1) == shuffled(E, E + 4, 2, seed=1) != contiguous(E, E + 4, 2)


def test_tbo_split_follows_sglang_and_decode_lags_two_stages():
    assert tbo.split_seq_index(False, [10, 1, 1, 8]) == 1        # |10 - 10| = 0
    assert tbo.split_seq_index(False, [3, 3, 3, 3]) == 2
    assert tbo.split_seq_index(True, [1] * 7) == 3
    assert tbo.delta_stages(True) == 2 and tbo.delta_stages(False) == 0
    assert tbo.schedule(3, 0) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert tbo.schedule(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    plan = MOE.get("ep").overlap_plan(EPConfig(tbo=True), 9, decode=True)
    assert plan == {"micro_tokens": (5, 4), "stages": ("dispatch", "experts", "combine"), "delta": 2}
    assert MOE.get("ep").overlap_plan(EPConfig(), 9, decode=True) is None


def test_expert_slots_describe_the_placement_for_a_cost_model():
    assert MOE.get("ep").expert_slots(EPConfig(num_redundant_experts=2), 8, 2) == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    assert MOE.get("triton_fused").expert_slots(None, 8, 2) is None
