"""Issue 19, round 2: PR #1970's setup as its code stood at its figures. The Triton MLA decode kernel before SGLang
PR #2394 (`sim.cost.mla_decode_kernel=logits`) and conf/experiment/pr1970_nov2024.yaml with predict.py's DP-only
facts (no CUDA graphs before PR #2061, schedule_conservativeness 1.0 before PR #2096). The kernel's constants are
sglang 0.3.5's (plugins/cost/roofline.py LOGITS_KERNEL)."""
from dataclasses import asdict, replace

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step
from plugins.cost.roofline import logits_stage, wave_factor
from roofline_helpers import cost, h100, v2  # noqa: F401 (v2, h100: fixtures)
from script_loader import load_script


def decode(n, context, groups=1):
    return Step(tuple(BatchShape("decode", (1,) * n, (context,) * n) for _ in range(groups)))


def test_the_kernel_before_pr2394_writes_and_reads_the_logits_and_reads_the_values_again(v2, h100):
    """Against one pass over the latent (no splits, read once): stage 2 is a second kernel that reads back the
    heads x cached-token logits stage 1 wrote (fp16, SGLang's reduce dtype) and the kv_lora_rank-wide values. At TP 8
    (16 heads, one head block) and a batch that fills whole waves (528 = 4 x 132 stage-2 programs, 5 x 528 = 10 x 264
    stage-1 programs) that is one more kernel latency plus those bytes at the attention's bandwidth, per layer."""
    n, ctx = 528, 256
    heads, seen = v2.num_heads // 8, n * (ctx + 1)
    once = cost(v2, h100, mla_decode_kv_splits=0, decode_head_block=0).step_breakdown(decode(n, ctx))["attention_s"]
    for logit_bytes in (2, 4):
        c = cost(v2, h100, mla_decode_kernel="logits", attn_logits_bytes=logit_bytes)
        extra = c.step_breakdown(decode(n, ctx))["attention_s"] - once
        nbytes = 2 * seen * heads * logit_bytes + seen * v2.kv_lora_rank * 2
        assert extra == pytest.approx(v2.num_layers * (c.rf._gemm_lat + nbytes / c.rf._gemm_bw), rel=1e-6)


def test_the_kernel_of_the_date_blocks_heads_by_64_and_spills_only_past_255_registers(v2):
    """sglang 0.3.5's constants: BLOCK_H = max(16, min(64, next_pow2(heads))), so 128 heads a rank (DP attention)
    run as 2 head blocks (the latent read twice per stage) and 16 (TP 8) as one. Stage 2 carries acc [BLOCK_H, 512],
    e_max, e_sum and p [BLOCK_H, 128] in fp32 over 8 warps: under 255 registers a thread at both layouts, so nothing
    spills; a [128, 512] accumulator over 4 warps would, by what exceeds 255 a thread, per loop step."""
    width, rank = v2.kv_cache_width, v2.kv_lora_rank
    for heads, block_h, blocks in ((128, 64, 2), (16, 16, 1)):
        st = logits_stage("reducev", heads, width, rank, 2, 2)
        assert (st.block_h, st.head_blocks, st.threads) == (block_h, blocks, 256)
        assert st.regs == (block_h * rank + 2 * block_h + block_h * st.block_n) / st.threads
        assert st.regs < 255 and st.spill_bytes == 0
        s1 = logits_stage("scores", heads, width, rank, 2, 2)
        assert s1.regs == (block_h * width * 2 + block_h * s1.block_n * 4) / 4 / s1.threads < 255
        assert s1.spill_bytes == 0 and s1.head_blocks == blocks
    big = logits_stage("reducev", 128, width, rank, 2, 2, warps=4, block_h=128)
    assert big.spill_bytes == (big.regs - 255) * 4 * 128 > 0


def test_bad_kernel_settings_name_what_is_allowed(v2, h100):
    with pytest.raises(ValueError, match="mla_decode_kernel='flash' is not one of split_kv, logits"):
        cost(v2, h100, mla_decode_kernel="flash")
    with pytest.raises(ValueError, match="attn_logits_bytes=3 must be 2 \\(fp16\\) or 4 \\(fp32\\)"):
        cost(v2, h100, attn_logits_bytes=3)


def test_spilled_bytes_are_paid_per_loop_step(v2, h100):
    """Given a stage-2 spill of X bytes a loop step, each layer pays 2X (stored, loaded) per program step: doubling
    the context doubles the extra time. DP attention, 66 requests a rank: 132 stage-2 programs, one full wave."""
    c = cost(v2, h100, "dp_attn", mla_decode_kernel="logits")
    spilling = dict(c._stages, reducev=replace(c._stages["reducev"], spill_bytes=1e5))
    extras = []
    for ctx in (255, 511):                         # 2 and 4 loop steps of 128 tokens
        plain = c._logits_decode(66 * (ctx + 1), 66)
        c._stages, saved = spilling, c._stages
        extras.append(c._logits_decode(66 * (ctx + 1), 66) - plain)
        c._stages = saved
        steps = 2 * 66 * (ctx + 1) // 128            # head blocks x requests x steps
        assert extras[-1] == pytest.approx(2 * 1e5 * steps / c.rf._gemm_bw, rel=1e-6)
    assert extras[1] == pytest.approx(2 * extras[0], rel=1e-6)


def test_a_partial_wave_costs_a_whole_one(v2, h100):
    """Programs beyond what the SMs hold at once run in another wave, each at a full wave's share of the bandwidth:
    DP attention puts one stage-2 program (64 heads) per SM, so 66 requests a rank (132 programs) run in one wave,
    132 in two (twice the time), and 67 (134 programs) pay a second wave for 2 programs."""
    assert wave_factor(132, 132) == 1 and wave_factor(264, 132) == 1 and wave_factor(134, 132) == 264 / 134
    assert wave_factor(66, 132) == 2                     # half the SMs idle: each program's walk at a full wave's share
    c = cost(v2, h100, "dp_attn", mla_decode_kernel="logits")
    lat = c.rf._gemm_lat

    def kernel(n):
        return c._logits_decode(n * 256, n) - 2 * lat

    assert kernel(132) == pytest.approx(2 * kernel(66), rel=1e-9)
    assert kernel(67) > 1.4 * kernel(66) * 67 / 66
    c = cost(v2, h100, "dp_attn", mla_decode_kernel="logits", mla_decode_occupancy=False)   # its bytes only
    assert kernel(67) == pytest.approx(kernel(66) * 67 / 66, rel=1e-9)


def test_pr1970_as_of_its_figures_is_pr1970_plus_the_facts_of_its_date():
    SETUPS = load_script("experiments/sim_repro/predict.py").SETUPS
    experiment, per_scheme = SETUPS[2]
    base = asdict(compose(["experiment=pr1970", "parallel=dp_attn"]))
    then = compose([f"experiment={experiment}", "parallel=dp_attn"] + per_scheme["dp_attn"])
    assert then.sim.cost.mla_decode_kernel == "logits" and base["sim"]["cost"]["mla_decode_kernel"] == "split_kv"
    assert then.engine.cuda_graph is False and then.parallel.schedule_conservativeness == 1.0
    diff = _differences(base, asdict(then))
    assert diff == {"sim.cost.mla_decode_kernel", "engine.cuda_graph", "parallel.schedule_conservativeness"}
    assert set(per_scheme) == {"dp_attn"}          # the TP cells run the same experiment with nothing added


def _differences(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        out = set()
        for k in set(a) | set(b):
            out |= _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return set() if a == b else {prefix.rstrip(".")}
