"""The roofline primitives and the roofline cost model: limits, monotonicity, and the brute-force expectations
its MoE terms rest on."""
import itertools
import random

from dataclasses import replace

import pytest

from framework.config import compose
from framework.core.registry import COST, MOE, PARALLELISM, RegistryError
from framework.contracts.cost import BatchShape, Collective, InstanceShape, Step
from framework.gpu.roofline import Roofline
from plugins.cost.lib.expert_load import expected_touched
from plugins.moe.ep import expected_destinations


@pytest.fixture(scope="module")
def h100():
    return compose(["hardware=h100_sxm"]).hardware


@pytest.fixture(scope="module")
def v2():
    return compose(["model=deepseek_v2"]).model


# the GPU's part alone: the host terms (scheduler CPU, eager floor) off; tests/sim/test_v04_terms.py tests them
GPU_ONLY = dict(eager_floor=False, host_step_us=0.0, host_running_us=0.0, host_new_req_us=0.0)


def cost_model(model, hw, parallel="tp", size=8, moe="triton_fused", dispatch="all_reduce", weight_dtype=None,
               **cfg):
    moe_cfg = MOE.get(moe).Config(dispatch=dispatch) if moe == "ep" else None
    inst = InstanceShape(replace(model, weight_dtype=weight_dtype), hw, parallel=parallel, size=size, moe=moe,
                    moe_cfg=moe_cfg)
    return COST.build("roofline", COST.get("roofline").Config(**(GPU_ONLY | cfg)), inst)


def decode(cost, batch, context=256, graph=True):
    groups = cost.lay.groups
    shape = BatchShape("decode", (1,) * (batch // groups), (context,) * (batch // groups))
    return Step((shape,) * groups, graph=graph)


def test_gemm_is_memory_bound_at_one_row_and_compute_bound_at_many(h100):
    rf = Roofline(h100)
    g = rf.fit.gemm
    n, k = 8192, 8192
    weights_read = k * n * 2 / (h100.hbm_gb_s * 1e9 * g.mem_eff)
    assert rf.gemm(1, n, k) == pytest.approx(g.latency_us * 1e-6 + weights_read, rel=0.01)
    m = 16384
    compute = 2 * m * n * k * (1 + g.half_m / m) / (h100.bf16_tflops * 1e12 * g.compute_eff)
    assert rf.gemm(m, n, k) == pytest.approx(g.latency_us * 1e-6 + compute)
    times = [rf.gemm(m, n, k) for m in (1, 8, 64, 256, 1024, 4096, 16384)]
    assert times == sorted(times)
    assert rf.gemm(1, n, k, weight_bytes=1) < rf.gemm(1, n, k)      # fp8 weights: half the bytes
    assert rf.gemm(m, n, k, dtype="fp8") < rf.gemm(m, n, k)           # and twice the peak


def test_collectives(h100):
    rf = Roofline(h100)
    assert rf.collective("all_reduce", 1 << 20, 1) == 0.0
    sizes = [1 << p for p in range(10, 30, 2)]
    times = [rf.collective("all_reduce", s, 8) for s in sizes]
    assert times == sorted(times)
    big = 1 << 30      # bandwidth-bound: a ring all-reduce moves twice an all-gather's bytes
    assert rf.collective("all_reduce", big, 8) / rf.collective("all_gather", big, 8) == pytest.approx(2, rel=0.01)
    assert rf.collective("all_reduce", big, 16) > 5 * rf.collective("all_reduce", big, 8)   # across nodes: NICs
    three = rf.collective("all_reduce", big, 3)      # between the profiled 2 and 4 ranks
    assert rf.collective("all_reduce", big, 2) > three / 2 and three > 0
    with pytest.raises(ValueError, match="unknown collective .broadcast.; known: all_reduce, all_gather"):
        rf.collective("broadcast", 1, 2)


def test_expected_touched_experts_and_destinations_match_brute_force():
    rng = random.Random(0)
    experts, top_k, ranks = 16, 3, 4
    for tokens in (1, 3, 10):
        draws = [len(set(itertools.chain.from_iterable(rng.sample(range(experts), top_k) for _ in range(tokens))))
                 for _ in range(8000)]
        assert sum(draws) / len(draws) == pytest.approx(expected_touched(experts, top_k, tokens), rel=0.02)
    picks = list(itertools.combinations(range(experts), top_k))
    exact = sum(len({e // (experts // ranks) for e in p}) for p in picks) / len(picks)
    assert expected_destinations(ranks, top_k, experts) == pytest.approx(exact)


def test_decode_is_memory_bound_at_small_batch_and_prefill_compute_bound():
    """H200 is the H100's compute die with 1.43x the HBM bandwidth: a small decode batch speeds up with it, a long
    prefill hardly does. (DeepSeek-V2-Lite on one GPU: on eight, a small batch's kernels are latency-bound.)"""
    lite = compose(["model=deepseek_v2_lite"]).model
    h100, h200 = (compose([f"hardware={n}"]).hardware for n in ("h100_sxm", "h200"))
    slow, fast = cost_model(lite, h100, size=1), cost_model(lite, h200, size=1)
    small = decode(slow, 8)
    assert slow.step_time(small) / fast.step_time(small) > 1.2
    prefill = Step((BatchShape("extend", (8192,), (0,)),), graph=True)
    assert slow.step_time(prefill) / fast.step_time(prefill) < 1.08


def test_step_time_grows_with_batch_and_context_and_fp8_helps_decode(v2, h100):
    cost = cost_model(v2, h100)
    by_batch = [cost.step_time(decode(cost, b)) for b in (1, 8, 64, 256, 1024)]
    assert by_batch == sorted(by_batch) and by_batch[-1] > 1.5 * by_batch[0]
    by_context = [cost.step_time(decode(cost, 256, c)) for c in (16, 256, 4096)]
    assert by_context == sorted(by_context)
    assert cost_model(v2, h100, weight_dtype="fp8").step_time(decode(cost, 8)) < 0.9 * by_batch[1]
    eager = cost.step_breakdown(decode(cost, 8, graph=False))
    assert eager["launch_s"] == pytest.approx(eager["kernels"] * h100.launch_overhead_us * 1e-6)
    assert eager["total_s"] >= cost.step_time(decode(cost, 8))


@pytest.mark.parametrize("head_block", [0, 16])
def test_mla_kv_reads_favour_dp_attention_at_long_context_with_one_read(v2, h100, head_block):
    """TP replicates the one latent per token on every rank, so each rank reads every request's KV; under DP
    attention each rank reads its own requests' only (but holds all heads' weights): with a kernel that reads the
    latent once for all heads, the longer the context, the more DP attention's attention time wins. SGLang v0.4's
    kernel reads it once per 16 heads: DP attention's 128 heads read it 8 times, and the win is gone."""
    def model(parallel):
        inst = InstanceShape(v2, h100, parallel=parallel, size=8, moe="triton_fused")
        return COST.build("roofline", COST.get("roofline").Config(decode_head_block=head_block), inst)
    tp, dp = model("tp"), model("dp_attn")
    ratios = []
    for context in (256, 4096, 16384):
        tp_attn = tp.step_breakdown(decode(tp, 512, context))["attention_s"]
        ratios.append(tp_attn / dp.step_breakdown(decode(dp, 512, context))["attention_s"])
        assert tp_attn > v2.num_layers * 512 * context * v2.kv_cache_width * 2 / (h100.hbm_gb_s * 1e9)
    if head_block == 0:
        assert ratios == sorted(ratios) and ratios[-1] > 4
    else:
        assert all(0.8 < r < 1.25 for r in ratios), ratios


def test_prefix_switches_to_the_absorbed_form_and_idle_ranks_join(v2, h100):
    tp = cost_model(v2, h100)
    fresh = tp.step_time(Step((BatchShape("extend", (512, 512), (0, 0)),)))
    cached = tp.step_time(Step((BatchShape("extend", (512, 512), (0, 64)),)))
    assert fresh != cached
    dp = cost_model(v2, h100, parallel="dp_attn")
    one = BatchShape("extend", (1024,), (0,))
    alone = dp.step_breakdown(Step((one,) + (BatchShape(),) * 7))
    assert alone["ffn_s"] == dp.step_breakdown(Step((one,) * 8))["ffn_s"]   # padded all-gather: 8 x 1024 rows


def test_declared_collectives_replace_the_fallback(v2, h100):
    cost = cost_model(v2, h100)
    step = decode(cost, 64)
    none = cost.step_breakdown(Step(step.batches, graph=True, collectives=()))
    assert none["comm_s"] == 0 and cost.step_breakdown(step)["comm_s"] > 0
    one = Collective("all_reduce", 64 * v2.hidden_size * 2, 8, count=v2.num_layers)
    assert cost.step_breakdown(Step(step.batches, True, (one,)))["comm_s"] == pytest.approx(
        v2.num_layers * cost.rf.collective("all_reduce", one.nbytes, 8))


def test_every_declared_layout_prices_a_step(v2, h100):
    for parallel, moe, dispatch in itertools.product(("tp", "dp_attn"), ("reference", "triton_fused", "ep"),
                                                     ("all_to_all", "all_reduce")):
        cost = cost_model(v2, h100, parallel=parallel, moe=moe, dispatch=dispatch)
        assert cost.step_time(decode(cost, 64)) > 0


def test_bad_input_fails_clearly(v2, h100):
    cost = cost_model(v2, h100, parallel="dp_attn")
    with pytest.raises(ValueError, match="has 8 batches \\(one per scheduler\\), got 1"):
        cost.step_time(Step((BatchShape("decode", (1,), (5,)),)))
    with pytest.raises(RegistryError, match="unknown parallelism plugin 'pp'; known: dp_attn, dp_attn_tp, single, tp"):
        cost_model(v2, h100, parallel="pp")
    with pytest.raises(ValueError, match="weight_dtype='int4' is not one of None, fp8"):
        replace(v2, weight_dtype="int4").validate()
    with pytest.raises(ValueError, match="batch mode 'prefill' is not one of extend, decode, idle"):
        BatchShape("prefill", (3,), (0,))
    with pytest.raises(ValueError, match="one prefix length per request: 2 requests, 1 prefix lengths"):
        BatchShape("decode", (1, 1), (5,))


def test_a_new_plugin_brings_its_own_cost(v2, h100, monkeypatch):
    """The roofline names no plugin: a scheme registered here (TP that all-reduces every layer twice) and a backend
    (the fused kernel's weights split as whole experts) are priced from their own declarations."""
    tp_cls, fused_cls = PARALLELISM.get("tp"), MOE.get("triton_fused")

    class TwiceTP(tp_cls):
        @classmethod
        def layer_comm(cls, cfg, model_cfg, tokens, ffn_layout, ffn_partial):
            return 2 * super().layer_comm(cfg, model_cfg, tokens, ffn_layout, ffn_partial)

    class WholeExperts(fused_cls):
        @classmethod
        def expert_split(cls, cfg, size):
            return size, 1

    monkeypatch.setitem(PARALLELISM._items, "twice_tp", TwiceTP)
    monkeypatch.setitem(MOE._items, "whole_experts", WholeExperts)
    base, twice = cost_model(v2, h100), cost_model(v2, h100, parallel="twice_tp")
    whole = cost_model(v2, h100, moe="whole_experts")
    step = decode(base, 64)
    per_layer = sum(base.rf.collective(c.kind, c.bytes, len(c.ranks))          # TP x fused: every layer alike
                    for c in tp_cls.layer_comm(tp_cls.Config(size=8), v2, [64] * 8, "all", True))
    extra = twice.step_breakdown(step)["comm_s"] - base.step_breakdown(step)["comm_s"]
    assert extra == pytest.approx(v2.num_layers * per_layer)
    assert whole.lay.expert_split == 8 and whole.lay.inter_split == 1
    assert whole.step_breakdown(step)["ffn_s"] != base.step_breakdown(step)["ffn_s"]
