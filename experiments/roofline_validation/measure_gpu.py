"""Measure GEMM times on the GPU at hand at the shapes the roofline prices for DeepSeek models: bf16 and fp8
(torch._scaled_mm), plain and batched. Needs only torch and a CUDA GPU; run.py compares the roofline with it.

Each case runs R back-to-back copies of the op inside one CUDA graph (no host launch gaps between them, as a
serving engine's decode graph runs), timed with CUDA events around a replay: time per op = replay time / R, median
of replays. Two variants: `hbm`, each copy reading its own weights, more of them than the L2 cache holds (a model's
layers stream their weights from HBM), and `l2`, every copy reading the same weights (what a profiler's loop sees).

    python experiments/roofline_validation/measure_gpu.py OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

REPLAYS, HBM_BYTES = 7, 1 << 30   # the hbm variant's weights take at least this much (the H200's L2: 60 MB)
# (n, k): DeepSeek-V2/V3 projections under TP 8 and DP attention, dense FFN and lm_head slices, a large Llama GEMM
SHAPES = [(1536, 5120), (576, 5120), (3072, 1536), (5120, 2048), (24576, 1536), (5120, 16384), (3072, 5120),
          (5120, 1536), (12800, 5120), (1536, 7168), (7168, 2048), (57344, 8192)]
ROWS = (1, 8, 32, 128, 512, 2048, 8192)
FP8_ROWS = (16, 32, 128, 512, 2048, 8192)      # _scaled_mm wants multiples of 16
# batched (grouped-expert-like): experts, rows per expert, n, k (an expert's gate_up and down slices under TP 8)
BATCHED = [(b, m, n, k) for b in (16, 160) for m in (1, 8, 64) for n, k in ((384, 5120), (5120, 192))]


def per_op_time(op, weights: list) -> float:
    """Median seconds per op over graph replays of `len(weights)` (at least 8) ops, each on the next weights."""
    copies = max(len(weights), 8)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights:           # warm-up: cuBLAS picks and loads its kernels outside the capture
            op(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            op(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / copies)
    del graph
    return statistics.median(times)


def measure(make_weight, op, nbytes: int) -> dict:
    """Both variants for one shape: `hbm` over enough distinct weights to miss the L2, `l2` over one."""
    distinct = max(1, min(64, -(-HBM_BYTES // nbytes)))
    weights = [make_weight() for _ in range(distinct)]
    out = {"hbm_s": per_op_time(op, weights), "l2_s": per_op_time(op, weights[:1])}
    del weights
    torch.cuda.empty_cache()
    return out


def main(path: str) -> None:
    dev = torch.device("cuda")
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    one = torch.ones((), device=dev, dtype=torch.float32)
    cases = []
    for n, k in SHAPES:
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=bf16)
            t = measure(lambda: torch.randn(k, n, device=dev, dtype=bf16), lambda w: torch.mm(x, w), 2 * n * k)
            cases.append({"dtype": "bfloat16", "batch": 1, "m": m, "n": n, "k": k, **t})
        for m in FP8_ROWS:
            x = torch.randn(m, k, device=dev, dtype=bf16).to(fp8)
            t = measure(lambda: torch.randn(n, k, device=dev, dtype=bf16).to(fp8).t(),   # column-major
                        lambda w: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=bf16), n * k)
            cases.append({"dtype": "fp8", "batch": 1, "m": m, "n": n, "k": k, **t})
    for b, m, n, k in BATCHED:
        x = torch.randn(b, m, k, device=dev, dtype=bf16)
        t = measure(lambda: torch.randn(b, k, n, device=dev, dtype=bf16), lambda w: torch.bmm(x, w), 2 * b * n * k)
        cases.append({"dtype": "bfloat16", "batch": b, "m": m, "n": n, "k": k, **t})
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = per_op_time(lambda _: dst.copy_(src), [None])
    info = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "replays": REPLAYS,
            "copy_gb_s": 2 * src.numel() / copy_s / 1e9, "method": "graph replays of back-to-back ops (docstring)"}
    with open(path, "w") as f:
        json.dump({"info": info, "cases": cases}, f, indent=1)
    print(info, len(cases), "cases")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the JSON file to write")
    main(ap.parse_args().out)
