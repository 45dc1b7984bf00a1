"""Issue 21's simulator terms (plugins/cost/lib/): DeepEP's dispatch modes, expert-load skew with EPLB, two-batch
overlap. Each moves what it should, on DeepSeek-V3's shapes at EP16 (small enough to build fast)."""
from __future__ import annotations

import ast
import json
from dataclasses import replace
from functools import lru_cache

import pytest

from framework.config import compose
from framework.contracts.cost import InstanceShape, Step, decode_shape
from framework.core.errors import UserError
from framework.core.registry import COST
from plugins.cost.lib import deepep, expert_load, tbo

@lru_cache(maxsize=None)
def base():
    """The decode experiment at EP16, composed once; variants replace fields of its configs."""
    return compose(["experiment=wide_ep_decode", "parallel.size=16"])


def decode_step(*overrides: str, batch: int = 256) -> dict:
    """`overrides`: "moe.<field>=v", "moe.eplb.<field>=v" or "sim.cost.<field>=v" (values as Python literals or
    strings)."""
    return decode_model(*overrides).step_breakdown(Step((decode_shape(batch, batch * 2000),) * 16, graph=True))


def decode_model(*overrides: str):
    """The cost model of the decode experiment at EP16 with `overrides` (as decode_step)."""
    cfg = base()
    moe, eplb, cost = {}, {}, {}
    for o in overrides:
        key, _, raw = o.partition("=")
        try:
            value = {"true": True, "false": False}.get(raw, None)
            value = ast.literal_eval(raw) if value is None else value
        except (ValueError, SyntaxError):
            value = raw
        {"moe": moe, "moe.eplb": eplb, "sim.cost": cost}[key.rpartition(".")[0]][key.rpartition(".")[2]] = value
    moe_cfg = replace(cfg.moe, eplb=replace(cfg.moe.eplb, **eplb), **moe)
    inst = InstanceShape(cfg.model, cfg.hardware, cfg.parallel.name, 16, cfg.moe.name, cfg.parallel, moe_cfg)
    return COST.build(cfg.sim.cost.name, replace(cfg.sim.cost, **cost), inst)


def test_low_latency_tables_reproduce_deepep_latencies():
    v3 = base().model
    for ep, (d_us, _, c_us, _) in deepep.LOW_LATENCY.items():
        d, c = deepep.low_latency_s(deepep.LOW_LATENCY_TOKENS, ep, v3, True, 2)
        assert d * 1e6 == pytest.approx(d_us, rel=0.03) and c * 1e6 == pytest.approx(c_us, rel=0.03)


def test_low_latency_replays_graphs_normal_does_not():
    low = decode_step("moe.dispatch=deepep_low_latency")
    normal = decode_step("moe.dispatch=deepep_normal")
    assert low["graph"] == 1.0 and normal["graph"] == 0.0
    assert low["launch_s"] == 0.0 and normal["launch_s"] > 0.0
    assert deepep.mode_for("deepep_auto", decode=True) == "deepep_low_latency"
    assert deepep.mode_for("deepep_auto", decode=False) == "deepep_normal"
    with pytest.raises(ValueError, match="cannot run under DP attention"):
        decode_step("moe.dispatch=deepep_auto")


def test_deepep_rows_arrive_in_fp8_so_no_receiver_quantizes_the_groups_tokens():
    # SGLang 2025's token_dispatcher.py: the normal sender quantizes its own tokens, the low-latency kernel casts
    # inside DeepEP and sums the weighted outputs in its combine; v0.4's all-gather EP quantizes every token
    model, group = decode_model(), 16 * 256
    v04, low, normal = (model._moe_parts(256, group, mode) for mode in ("", "deepep_low_latency", "deepep_normal"))
    hidden, quant = model.m.hidden_size, model.act + 1          # a quantization reads act bytes, writes 1
    assert v04[1][0] - low[1][0] == pytest.approx(model.rf.memop("act", group * hidden * quant))
    assert low[2] == (0.0, 0) and v04[2][0] > 0
    assert normal[0][0] == pytest.approx(low[0][0] + model.rf.memop("act", 256 * hidden * quant))
    assert normal[1][0] > low[1][0]                 # ep_scatter: the received rows into the contiguous layout


def test_dense_dp_drops_the_dense_layers_gather():
    gathered = decode_step("sim.cost.dense_dp=false", "moe.tbo=false")
    local = decode_step("sim.cost.dense_dp=true", "moe.tbo=false")
    assert local["comm_s"] < gathered["comm_s"]     # the FLOPs stay: the same tokens, the whole weights


def test_skew_raises_the_moe_step_and_eplb_lowers_it():
    uniform = decode_step("sim.cost.expert_loads=uniform", "moe.tbo=false")
    skewed = decode_step("sim.cost.expert_loads=zipf", "moe.tbo=false", "moe.eplb.rebalance_every=0")
    balanced = decode_step("sim.cost.expert_loads=zipf", "moe.tbo=false")
    assert skewed["moe_rank_imbalance"] > 2 * balanced["moe_rank_imbalance"]
    assert skewed["ffn_s"] > balanced["ffn_s"] >= uniform["ffn_s"] * 0.99
    assert skewed["comm_s"] > balanced["comm_s"]


def test_two_batch_overlap_pays_at_large_decode_batches_only():
    def gain(batch):
        on, off = decode_step(batch=batch), decode_step("moe.tbo=false", batch=batch)
        return off["total_s"] / on["total_s"] - 1
    big, small = gain(256), gain(32)
    assert big > 0.1 and small < big / 4        # the split reads every weight twice: small batches gain nothing


def test_overlap_schedule_hides_communication_behind_compute():
    layer = tbo.decode_layer(1.0, 1.0, 0.5, 0.5, 1.0, 2.0, 2.0)
    serial = 2 * 20 * (1 + 1 + 0.5 + 0.5 + 1 + 2 + 2)       # both micro-batches, nothing overlapped
    t = tbo.overlapped_s((layer, layer), 20, 2)
    assert 2 * 20 * 4.0 <= t < 0.8 * serial                  # at least the compute; well under the sum
    quiet = tbo.decode_layer(1.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.0)
    assert tbo.overlapped_s((quiet, quiet), 20, 2) == pytest.approx(2 * 20 * 4.0)


def test_zipf_shares_and_eplb_placement(tmp_path):
    import random
    shares = expert_load.zipf_shares(256, 8, 1.0, random.Random(0))
    assert sum(shares) == pytest.approx(1.0) and max(shares) <= 1 / 8 + 1e-12
    slots = [e % 256 for e in range(288)]
    placed = expert_load.rebalance(shares, 288, 16)
    assert sorted(set(placed)) == list(range(256))
    assert expert_load.rank_imbalance(shares, placed, 16) < 0.5 * expert_load.rank_imbalance(shares, slots, 16)
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"expert_load": {"layer3": [1, 2, 3]}}))
    with pytest.raises(UserError, match="256 expert loads"):
        expert_load.read_loads(str(path), 256)


def test_recorded_loads_replay_from_a_file(tmp_path):
    hot = [100.0] * 16 + [1.0] * 240                          # experts 0-15 hot: contiguous blocks put them on rank 0
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"expert_load": {"layer3": hot, "layer4": hot}}))
    r = decode_step(f"sim.cost.expert_loads={path}", "moe.eplb.rebalance_every=0", "moe.num_redundant_experts=0")
    assert r["moe_rank_imbalance"] > 5
