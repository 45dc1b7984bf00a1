"""Issue 19, round 3: the Triton fused MoE at vLLM's 2024 default config on an H100 SXM, as published
(`sim.cost.fused_moe_rates`, plugins/cost/lib/fused_moe_triton.py): at the measured shape the routed experts and
their weighted sum cost the published call times; elsewhere the rate is a ceiling by rows per touched expert, for an
fp8 model on the fused MoE only."""
from dataclasses import replace

import pytest

from framework.config import compose
from framework.contracts.cost import InstanceShape
from framework.core.registry import COST
from plugins.cost.lib import fused_moe_triton as published_moe
from roofline_helpers import cost, h100, v2  # noqa: F401 (v2, h100: fixtures)


def routed_s(c, tokens):
    """The routed experts and their weighted sum, the parts the published call times hold."""
    _, routed, combine, _ = c._moe_parts(tokens, tokens)
    return routed[0] + combine[0]


def test_at_the_measured_shape_the_experts_cost_the_published_call_times(v2, h100):
    qwen3 = replace(v2, hidden_size=published_moe.HIDDEN, n_routed_experts=published_moe.EXPERTS, num_experts_per_tok=published_moe.TOP_K,
                    moe_intermediate_size=published_moe.INTER, n_shared_experts=0)
    inst = InstanceShape(qwen3, h100, parallel="tp", size=1, moe="triton_fused")
    fitted, published = (COST.build("roofline", COST.get("roofline").Config(fused_moe_rates=on), inst)
                         for on in (False, True))
    for tokens, us in published_moe.MAIN_US.items():
        assert routed_s(published, tokens) == pytest.approx(max(us * 1e-6, routed_s(fitted, tokens)), rel=1e-6)
    assert routed_s(fitted, 4096) < 0.4 * published_moe.MAIN_US[4096] * 1e-6     # the fitted rate: over 3x the kernel's


def test_the_rate_is_a_ceiling_by_rows_per_expert_for_fp8_on_the_fused_moe_only(v2, h100):
    """DeepSeek-V2 at TP 8 (160 experts, top-6): the rows per touched expert pick the rate (a decode batch of 1,100
    tokens: 41 rows; a prefill chunk of 8,192: 307, past the measured 256: the nearest rate); the switch never
    makes a step cheaper; a bf16 model or experts split across ranks (moe=ep) keep the fitted rates."""
    published = cost(v2, h100, fused_moe_rates=True)
    rows = 1100 * 6 / 160
    expected = published_moe.call_flops(1100 * 6, v2.hidden_size, v2.moe_intermediate_size / 8) / (published_moe.tflops(rows) * 1e12)
    assert routed_s(published, 1100) == pytest.approx(expected, rel=0.01)
    assert published_moe.tflops(8192 * 6 / 160) == published_moe.tflops(256) == published_moe.RATES[256.0]
    bf16 = replace(v2, weight_dtype=None)
    assert routed_s(cost(bf16, h100, fused_moe_rates=True), 8192) == routed_s(cost(bf16, h100), 8192)
    for moe, size in (("ep", 8), ("ep", 1), ("reference", 1)):    # not one fused MoE call (fused_moe_call)
        off, on = (COST.build("roofline", COST.get("roofline").Config(fused_moe_rates=rates),
                              InstanceShape(v2, h100, parallel="tp", size=size, moe=moe)) for rates in (False, True))
        assert routed_s(on, 8192) == routed_s(off, 8192), (moe, size)


def test_past_the_published_rows_the_rate_is_the_last_one_or_its_trend():
    """A chunk of 32,768 tokens (DP attention's gathered prefill) runs 1,229 rows a touched expert, 4.8x the last
    measured 256: `nearest` keeps the last rate, `extend` carries the last segment's log2 slope on (faster)."""
    last, rows = max(published_moe.RATES), 32768 * 6 / 160
    assert published_moe.tflops(rows) == published_moe.RATES[last]
    assert published_moe.tflops(rows, "extend") > published_moe.RATES[last]
    assert published_moe.tflops(100, "extend") == published_moe.tflops(100)      # inside the table: the same
    with pytest.raises(ValueError, match="fused_moe_rates_past='far' is not one of nearest, extend"):
        cost(compose(["model=deepseek_v2"]).model, compose(["hardware=h100_sxm"]).hardware,
             fused_moe_rates_past="far")


def test_the_rates_refuse_a_device_they_were_not_published_for(v2):
    a100 = compose(["hardware=a100_80g"]).hardware
    with pytest.raises(ValueError, match="published for hardware=h100_sxm only, got hardware=a100_80g"):
        cost(v2, a100, fused_moe_rates=True)


def test_round3_is_round2_with_the_published_moe_rates_on_every_cell():
    from script_loader import load_script
    SETUPS = load_script("experiments/sim_repro/predict.py").SETUPS
    (exp2, per2), (exp3, per3) = SETUPS[2], SETUPS[3]
    assert exp3 == exp2 and per3["dp_attn"] == per2["dp_attn"]
    assert per3["all"] == ["sim.cost.fused_moe_rates=true"] and set(per3) == {"all", "dp_attn"}
    assert compose([f"experiment={exp3}", "parallel=tp"] + per3["all"]).sim.cost.fused_moe_rates is True
