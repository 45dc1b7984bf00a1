"""Every MoE backend and dispatch form against experts_reference, at size 1 in-process and size 2 on gloo with real
spawned ranks, under both parallel styles' token-layout contracts (see moe_rank_fns.forward_under_contract)."""
from __future__ import annotations

import pytest
import torch

from framework.dist import Group
from framework.model.reference import experts_reference
from kernels import fused_moe_for
from framework.core.registry import MOE
from kernels.fused_moe import fused_moe_torch, fused_moe_triton
from moe_rank_fns import BACKENDS, E, H, I, SCENARIOS, STYLES, layer_weights, run_all_cases, step_inputs
from plugins.moe.ep import EPConfig, local_expert_range, pack_rows, unpack_rows
from plugins.moe.triton_fused import TritonFusedConfig, slice_intermediate

ATOL = 1e-4   # fp32


def _check(results: list[dict], size: int) -> None:
    expected_keys = {f"{n}/{s}/{b}" for n in SCENARIOS for s in STYLES for b in BACKENDS}
    for rank, res in enumerate(results):
        assert set(res["errors"]) == expected_keys
        assert all(v > 1.0 for v in res["reference_norms"].values()), res["reference_norms"]  # not a zero output
        bad = {k: v for k, v in res["errors"].items() if not v <= ATOL}
        assert not bad, f"size {size} rank {rank}: backends differ from experts_reference: {bad}"


def test_every_backend_matches_reference_at_size_1():
    _check([run_all_cases(Group())], 1)


@pytest.mark.long
def test_every_backend_matches_reference_at_size_2(size2_results):
    _check(size2_results, 2)


@pytest.mark.long
def test_size_2_layouts_and_weight_shards(size2_results):
    for res in size2_results:
        lay = res["layouts"]
        assert lay["reference"] == ("all", False, (E, 2 * I, H), (E, H, I))
        assert lay["triton_fused"] == ("all", True, (E, I, H), (E, H, I // 2))         # intermediate dim halved
        assert lay["ep_all_to_all"] == ("local", False, (E // 2, 2 * I, H), (E // 2, H, I))   # whole experts
        assert lay["ep_all_reduce"] == ("all", True, (E // 2, 2 * I, H), (E // 2, H, I))
        for key, cfg in BACKENDS.items():   # known before any rank starts, as the instance will declare them
            assert MOE.get(cfg.name).layout(cfg, 2) == lay[key][:2], key


def test_size_1_outputs_are_never_partial():
    w13, w2 = layer_weights()
    for key, cfg in BACKENDS.items():
        backend = MOE.build(cfg.name, cfg, w13, w2, Group())
        assert not backend.partial and (backend.token_layout, False) == MOE.get(cfg.name).layout(cfg, 1), key


@pytest.mark.long
def test_ep_rejects_an_expert_count_that_does_not_divide(size2_results):
    for res in size2_results:
        msg = res["bad_expert_count"]
        assert "n_routed_experts=7" in msg and "parallel.size=2" in msg


@pytest.mark.parametrize("size", [2, 4])
def test_intermediate_slices_sum_to_the_full_layer(size):
    """Gate and up rows sliced separately: the ranks' partial outputs add up to the full layer."""
    w13, w2 = layer_weights()
    _, hidden, ids, weights = step_inputs("uneven_loads", 1)
    total = sum(fused_moe_torch(hidden, *slice_intermediate(w13, w2, r, size), ids, weights) for r in range(size))
    torch.testing.assert_close(total, experts_reference(hidden, w13, w2, ids, weights), atol=ATOL, rtol=0)
    # One rank's slice alone is not the layer: the reduction is needed.
    partial = fused_moe_torch(hidden, *slice_intermediate(w13, w2, 0, size), ids, weights)
    assert (partial - total).abs().max() > 1e-2


def test_bad_sizes_and_options_fail_at_construction_with_the_allowed_values():
    w13, w2 = layer_weights()
    with pytest.raises(ValueError, match=r"moe_intermediate_size=16 across parallel.size=3"):
        slice_intermediate(w13, w2, 0, 3)
    with pytest.raises(ValueError, match=r"n_routed_experts=8 is not divisible by parallel.size=3"):
        local_expert_range(8, 0, 3)
    assert local_expert_range(8, 1, 2) == (4, 8)
    with pytest.raises(ValueError, match=r"moe.dispatch='alltoall' is not one of all_to_all, all_reduce"):
        MOE.build("ep", EPConfig(dispatch="alltoall"), w13, w2, Group())
    with pytest.raises(ValueError, match=r"moe.kernel='cuda' is not one of auto, triton, torch"):
        MOE.build("triton_fused", TritonFusedConfig(kernel="cuda"), w13, w2, Group())


def test_kernel_choice():
    assert fused_moe_for("auto", "cpu")[0] is fused_moe_torch     # CPU: the torch twin
    assert fused_moe_for("torch", "cpu")[0] is fused_moe_torch
    assert fused_moe_for("triton", "cpu")[0] is fused_moe_triton  # tests run the interpreter (tests/conftest.py)
    if torch.cuda.is_available():
        assert fused_moe_for("auto", "cuda")[0] is fused_moe_triton


def test_an_idle_rank_passes_empty_buffers_through_every_backend():
    w13, w2 = layer_weights()
    for key, cfg in BACKENDS.items():
        out = MOE.build(cfg.name, cfg, w13, w2, Group()).forward(
            torch.empty(0, H), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2))
        assert out.shape == (0, H), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 5])
def test_dispatch_rows_pack_and_unpack_bit_exactly(dtype, rows):
    hidden = torch.randn(rows, H).to(dtype)
    ids, weights = torch.randint(0, 300, (rows, 3)), torch.rand(rows, 3)
    got_hidden, got_ids, got_weights = unpack_rows(pack_rows(hidden, ids, weights), dtype, H, 3)
    assert got_hidden.dtype == dtype and torch.equal(got_hidden, hidden)
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


@pytest.mark.long
def test_eplb_moved_experts_between_forwards_and_every_rank_agrees_on_the_placement(size2_results):
    """The oracle above held while EPLB re-placed the slots (and moved weights) before every forward."""
    stats = [res["eplb"] for res in size2_results]
    assert stats[0]["phy2log"] == stats[1]["phy2log"]
    for s in stats:
        assert s["eplb_rebalances"] == s["forwards"] - 1 > 0
        assert s["eplb_experts_moved"] > 0 and s["eplb_bytes_moved"] == s["eplb_experts_moved"] * 3 * H * I * 4
