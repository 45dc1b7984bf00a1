"""Measure GEMM times on the GPU at hand, as Vidur's profiler does (each op timed alone with CUDA events, median of
repeats), at the shapes the roofline prices for DeepSeek models: bf16 and fp8 (torch._scaled_mm), plain and batched.
Needs only torch and a CUDA GPU; run.py compares the roofline with what this wrote.

    python experiments/roofline_validation/measure_gpu.py OUT.json
"""
from __future__ import annotations

import json
import statistics
import sys

import torch

REPEATS, WARMUP = 25, 5
# (n, k): DeepSeek-V2/V3 projections under TP 8 and DP attention, dense FFN and lm_head slices, a large Llama GEMM
SHAPES = [(1536, 5120), (576, 5120), (3072, 1536), (5120, 2048), (24576, 1536), (5120, 16384), (3072, 5120),
          (5120, 1536), (12800, 5120), (1536, 7168), (7168, 2048), (57344, 8192)]
ROWS = (1, 8, 32, 128, 512, 2048, 8192)
FP8_ROWS = (16, 32, 128, 512, 2048, 8192)      # _scaled_mm wants multiples of 16
# batched (grouped-expert-like): experts, rows per expert, n, k (an expert's gate_up and down slices under TP 8)
BATCHED = [(b, m, n, k) for b in (16, 160) for m in (1, 8, 64) for n, k in ((384, 5120), (5120, 192))]


def median_time(fn) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def main(out: str) -> None:
    dev = torch.device("cuda")
    cases = []
    for n, k in SHAPES:
        w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        w8 = w.to(torch.float8_e4m3fn).t().contiguous().t()          # column-major, as _scaled_mm wants
        one = torch.ones((), device=dev, dtype=torch.float32)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cases.append({"dtype": "bfloat16", "batch": 1, "m": m, "n": n, "k": k,
                          "time_s": median_time(lambda: torch.mm(x, w))})
        for m in FP8_ROWS:
            x8 = torch.randn(m, k, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            cases.append({"dtype": "fp8", "batch": 1, "m": m, "n": n, "k": k, "time_s": median_time(
                lambda: torch._scaled_mm(x8, w8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))})
        del w, w8
    for b, m, n, k in BATCHED:
        x = torch.randn(b, m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(b, k, n, device=dev, dtype=torch.bfloat16)
        cases.append({"dtype": "bfloat16", "batch": b, "m": m, "n": n, "k": k,
                      "time_s": median_time(lambda: torch.bmm(x, w))})
    info = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "repeats": REPEATS,
            "method": "each op alone between two CUDA events, median of repeats after warm-up (as Vidur)"}
    with open(out, "w") as f:
        json.dump({"info": info, "cases": cases}, f, indent=1)
    print(info, len(cases), "cases")


if __name__ == "__main__":
    main(sys.argv[1])
