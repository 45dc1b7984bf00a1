"""The Triton fused MoE at vLLM's 2024 default config, fp8_w8a8, on an H100 SXM: published call times as FLOP rates
by rows per expert, a ceiling on the roofline's fitted rates for the routed experts (`sim.cost.fused_moe_rates`;
issue 19, round 3).

Source: vllm-project/vllm PR #24700 (mgoin, 2025-09-11, "Improve default fused moe configs by analyzing tuned
configs", closed unmerged), "Benchmarks on H100", "Qwen3 MoE FP8": `benchmarks/kernels/benchmark_moe.py
--model=Qwen/Qwen3-30B-A3B -tp=1 --dtype=fp8_w8a8`, its "# Main" listing, taken at vLLM's default config of the time
(the PR changes only the defaults, and its "Main" and "PR" listings differ). For per-tensor fp8 that default had
not moved since 2024 (the PR: num_warps and num_stages "were omitted before except for block fp8"): vllm
0.6.3.post1's `get_default_config` (PyPI wheel) is BLOCK_SIZE_M/N/K 64/64/32 with GROUP_SIZE_M 8 above E tokens,
16/32/64/1 at or below, and that wheel ships no tuned config for E=160, N=192 on an H100. sglang 0.3.5 and 0.3.6
(PyPI wheels) run DeepSeek-V2 on vLLM's FusedMoE (models/deepseek_v2.py imports it): what PR #1970's fp8 DeepSeek-V2
ran. The device: H100 80GB HBM3 (the same PR's tuned Mixtral rows read configs named NVIDIA_H100_80GB_HBM3).

The measured shape: E = 128 experts, top-8, hidden 2,048, intermediate 768 (the gate_up GEMM's N: 1,536). A call on
B tokens does 2 x B x 8 x 2,048 x (1,536 + 768) FLOPs; its time also holds the alignment, the activation and the
top-k weighted sum. Carried to another shape by the rows each touched expert serves, B x 8 / E_touched(B) (uniform
routing): at equal rows an expert's weights serve as many rows, so the memory-bound rate and the compute-bound one
both move with the rows, not with N or K (an assumption: N and K also change the tile count and each tile's loop
length; and the default config switches at E tokens, so DeepSeek-V2's 161-213 tokens run the large one at 6-8 rows
where the source's batches of those rows, 96-128 tokens, ran the small one). Between measured rows linear in
log2; past them (`sim.cost.fused_moe_rates_past`) the nearest measured rate, or the last segment's log2 slope carried
on: the rate still rose 10% from 2,048 to 4,096 tokens, so the nearest rate prices a call past 256 rows slower than
the trend would. Not this kernel exactly: the
September 2025 code on a 2025 Triton, where PR #1970 ran Triton 3.0 (torch 2.4); no 2024 measurement was published,
and a newer compiler makes the rate an upper bound on 2024's, as a ceiling should be.
"""
from __future__ import annotations

from math import log2

from framework.gpu.tables import segment
from plugins.cost.lib.expert_load import expected_touched

HARDWARE = "h100_sxm"                 # the rates' device (conf/hardware/)
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
MAIN_US = {1: 44.54, 2: 59.94, 4: 90.46, 8: 129.77, 16: 185.40, 24: 215.99, 32: 238.37, 48: 257.83, 64: 262.73,
           96: 270.98, 128: 273.72, 256: 355.49, 512: 391.86, 1024: 536.33, 1536: 727.31, 2048: 911.64,
           3072: 1279.17, 4096: 1647.57}  # batch -> kernel time, us (PR #24700, "Qwen3 MoE FP8", "# Main")


def rows_per_expert(tokens: float, experts: int = EXPERTS, top_k: int = TOP_K) -> float:
    """The (token, expert) rows each touched expert serves, in expectation under uniform routing."""
    return tokens * top_k / expected_touched(experts, top_k, tokens)


def call_flops(rows: float, hidden: float, inter: float) -> float:
    """A fused MoE call's FLOPs: gate_up (2 x inter wide) and down over ``rows`` (token, expert) rows."""
    return 2.0 * rows * hidden * 3 * inter


RATES = {rows_per_expert(b): call_flops(b * TOP_K, HIDDEN, INTER) / (us * 1e-6) / 1e12
         for b, us in MAIN_US.items()}   # rows per touched expert -> TFLOP/s


PAST = ("nearest", "extend")     # how a rate past the measured rows is read (tflops)
_LOG_ROWS = [log2(r) for r in sorted(RATES)]
_BY_ROWS = [RATES[r] for r in sorted(RATES)]


def tflops(rows: float, past: str = "nearest") -> float:
    """The published call's FLOP rate (TFLOP/s) at ``rows`` rows per touched expert, linear in log2 of the rows;
    past the measured rows the last one's (nearest) or its segment carried on (extend)."""
    i, w = segment(_LOG_ROWS, log2(rows), extend=past == "extend")
    return _BY_ROWS[i] + w * (_BY_ROWS[i + 1] - _BY_ROWS[i])
