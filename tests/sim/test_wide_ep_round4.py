"""Issue 21, round 4: the published kernel rates the cost model can price SGLang 2025's kernels at (default off):
DeepGEMM's FP8 GEMM table, FlashAttention-3's causal prefill rates and its decode split count."""
from __future__ import annotations

from dataclasses import replace

import pytest

from framework.contracts.cost import BatchShape, InstanceShape, decode_shape
from framework.core.registry import COST
from plugins.cost.lib import deepgemm, fa3
from test_wide_ep import base          # the decode experiment at EP16, composed once for both files


def model(**cost):
    """DeepSeek-V3 under DP attention at EP16 with DeepEP's low-latency kernels, uniform loads, `cost` overrides."""
    cfg = base()
    inst = InstanceShape(cfg.model, cfg.hardware, cfg.parallel.name, 16, cfg.moe.name, cfg.parallel, cfg.moe)
    return COST.build("roofline", replace(cfg.sim.cost, expert_loads="uniform", **cost), inst)


def test_deepgemm_table_is_read_at_its_measured_points_and_between_them():
    assert deepgemm.tflops("normal", 4096, 7168, 16384) == 1520
    assert deepgemm.tflops("normal", 64, 2112, 7168) == 206
    assert deepgemm.tflops("masked", 512, 4096, 7168) == 1040
    assert deepgemm.tflops("normal", 16, 24576, 1536) == 289 and deepgemm.tflops("normal", 1e5, 24576, 1536) == 1212
    between = deepgemm.tflops("masked", 362, 7168, 2048)             # halfway in log2 between 256 and 512
    assert between == pytest.approx((815 + 916) / 2, rel=0.01)
    assert deepgemm.tflops("normal", 4096, 1536, 7168) is None        # q_a alone: no published row


def test_deepgemm_rates_cap_the_fp8_gemms_of_published_shapes_only():
    off, on = model(), model(deepgemm_rates=True)
    # q_b at 4,096 rows: the fitted rate is above DeepGEMM's 1,212 TFLOPS, so the published rate prices it
    flops, quant = 2 * 4096 * 24576 * 1536, off.rf.memop("act", 4096 * 1536 * (off.act + 1))   # input to fp8
    assert off._gemm(4096, 24576, 1536) - quant < flops / 1212e12
    assert on._gemm(4096, 24576, 1536) == pytest.approx(flops / 1212e12 + quant)
    # o_proj: DeepGEMM's 1,520 TFLOPS is above the fitted rate, and a ceiling never speeds a GEMM up
    assert on._gemm(4096, 7168, 16384) == off._gemm(4096, 7168, 16384)
    assert on._gemm(4096, 1536, 7168) == off._gemm(4096, 1536, 7168)                   # no row: unchanged
    assert on._gemm(4096, 7168, 16384, quantized=False) == off._gemm(4096, 7168, 16384, quantized=False)
    # the routed experts take the grouped tables: masked after low-latency dispatch, contiguous after normal
    for mode, layout, m in (("deepep_low_latency", "masked", 256), ("deepep_normal", "contiguous", 4096)):
        t_routed = 16 * m * 288 // (16 * 8)                           # m rows per expert slot on every rank
        routed_on, routed_off = on._moe_parts(t_routed // 16, t_routed, mode)[1][0], \
            off._moe_parts(t_routed // 16, t_routed, mode)[1][0]
        groups = 288 // 16
        floor = 2 * groups * m * 7168 * 2048 * (2 / deepgemm.tflops(layout, m, 4096, 7168)
                                               + 1 / deepgemm.tflops(layout, m, 7168, 2048)) / 1e12
        assert routed_on >= floor * 0.99 and routed_on >= routed_off


def test_fa3_prefill_rates_price_the_causal_attention_at_the_published_rate():
    assert fa3.prefill_tflops(4096, 128, 128) == 579 and fa3.prefill_tflops(16384, 256, 256) == 642
    assert fa3.prefill_tflops(4096, 192, 128) == pytest.approx(579 + 0.25 * (612 - 579))
    off, on = model(), model(fa3_prefill_rates=True)
    batch = BatchShape("extend", (4096, 4096), (0, 0))
    proj = off._projections(8192, True)[0]
    core_off, core_on = off._attention(batch, 8192)[0] - proj, on._attention(batch, 8192)[0] - proj
    flops = 2 * off._normal_flops * 4096 * 4097
    assert core_on == pytest.approx(on.rf._gemm_lat + flops / (fa3.prefill_tflops(4096, 192, 128) * 1e12))
    assert core_on > core_off                         # the fitted large-GEMM rate (752 TFLOPS) is above FA3's
    decode = decode_shape(128, 128 * 2000)            # the absorbed form is not FA3's MHA: unchanged
    assert on._attention(decode, 128) == off._attention(decode, 128)


def test_fa3_decode_splits_follow_its_scheduler():
    splits = [fa3.decode_splits(r, 128, 2000, 132) for r in (8, 16, 32, 64, 128, 256)]
    assert splits == sorted(splits, reverse=True) and splits[-2:] == [1, 1] and splits[1] == 4
    assert fa3.decode_splits(128, 128, 100, 132) == 1                # few KV blocks: never split
    off, on = model(), model(fa3_decode_splits=True)
    full, small = decode_shape(128, 128 * 2000), decode_shape(16, 16 * 2000)
    per_split = off.heads * (off.m.kv_lora_rank + 1) * 4              # fp32 partial output + log-sum-exp
    assert off._partials_bytes == 8 * per_split                       # v0.4's Triton: always 8 splits
    assert on._attention(full, 128)[1] == off._attention(full, 128)[1] - 1        # no combine kernel
    assert on._attention(full, 128)[0] < off._attention(full, 128)[0]
    assert off._attention(small, 16)[0] > on._attention(small, 16)[0] > model(mla_decode_kv_splits=0)._attention(
        small, 16)[0]                                                 # 4 splits: between none and 8
