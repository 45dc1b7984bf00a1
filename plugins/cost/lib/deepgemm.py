"""DeepGEMM's published FP8 GEMM rates (SGLang 2025 runs its expert GEMMs, and with SGL_ENABLE_JIT_DEEPGEMM=1 its
dense FP8 linear layers, on DeepGEMM), as a ceiling on the roofline's fitted rates (`sim.cost.deepgemm_rates`).

Source: deepseek-ai/DeepGEMM README.md "Performance" at 327ec92 (2025-04-09), the last version that publishes the
table (removed by 37aa127, 2025-04-14; a later news line says up to 1550 TFLOPS at its largest shape against the
table's 1520): H800 SXM5 (H100 SXM5's tensor-core peak), NVCC 12.8, every shape DeepSeek-V3/R1 inference uses
without tensor parallelism. Rows: (N, K) -> {M (normal) or M per group (grouped): TFLOPS}.

A GEMM whose (N, K) the table lists runs at most at the table's rate for its M (linear in log2 M between the measured
M, the nearest measured M outside them); other shapes keep the roofline's price. A ceiling, not a replacement: a
rate measured at a larger M bounds a smaller M's from above (GEMM rates grow with M).
"""
from __future__ import annotations

from framework.gpu.tables import interpolate

NORMAL = {  # dense models: M = tokens
    (2112, 7168): {64: 206, 128: 352, 4096: 1127},     # q_a and kv_a fused
    (24576, 1536): {64: 289, 128: 535, 4096: 1212},    # q_b
    (32768, 512): {64: 219, 128: 358, 4096: 775},      # kv_b
    (7168, 16384): {64: 336, 128: 645, 4096: 1520},    # o_proj
    (4096, 7168): {64: 287, 128: 533, 4096: 1410},     # gate_up of a 2,048-wide MLP (shared expert)
    (7168, 2048): {64: 295, 128: 510, 4096: 1168},     # its down
}
CONTIGUOUS = {  # MoE prefill (DeepEP normal dispatch): M per group, 4 or 8 groups
    (4096, 7168): {4096: 1346, 8192: 1346},
    (7168, 2048): {4096: 1214, 8192: 1214},
}
MASKED = {  # MoE decode (DeepEP low-latency dispatch, CUDA graph): M per group, 1, 2 or 4 groups
    (4096, 7168): {256: 932, 512: 1040, 1024: 1233},
    (7168, 2048): {256: 815, 512: 916, 1024: 925},
}
LAYOUTS = {"normal": NORMAL, "contiguous": CONTIGUOUS, "masked": MASKED}


def tflops(layout: str, m: float, n: float, k: float) -> float | None:
    """DeepGEMM's published TFLOPS for an [m, k] x [k, n] FP8 GEMM (m: rows per group for grouped layouts), or None
    where the table has no row for (n, k)."""
    row = LAYOUTS[layout].get((round(n), round(k)))
    if row is None or m <= 0:
        return None
    return interpolate(row, m, log=True)
