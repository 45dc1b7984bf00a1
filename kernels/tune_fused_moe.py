"""Tune fused_moe_kernel's launch settings for one MoE shape and write ``configs/E=..,N=..,device_name=...json``.

    python -m kernels.tune_fused_moe --experts 64 --intermediate 1408 --hidden 2048 --top-k 6 --dtype bfloat16

Times the whole layer (gate/up GEMM, activation, down GEMM) for every candidate and batch size on the current CUDA
device and keeps the fastest, as vLLM's benchmark_moe.py does. Without CUDA it runs the interpreter (with
--device cpu and TRITON_INTERPRET=1), which only checks the plumbing: its timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kernels.tuning import CONFIG_DIR, config_file_name

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def search_space(quick: bool = False) -> list[dict[str, int]]:
    axes = dict(BLOCK_SIZE_M=(16, 32, 64, 128), BLOCK_SIZE_N=(32, 64, 128, 256), BLOCK_SIZE_K=(64, 128),
                GROUP_SIZE_M=(1, 16), num_warps=(4, 8), num_stages=(2, 3, 4))
    if quick:
        axes.update(BLOCK_SIZE_N=(64, 128), BLOCK_SIZE_K=(64,), num_warps=(4,), num_stages=(3,))
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn in milliseconds (CUDA events on GPU, perf_counter elsewhere)."""
    fn()  # compile / warm up
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def tune(E: int, I: int, H: int, top_k: int, dtype: torch.dtype, device: torch.device,
         batch_sizes=BATCH_SIZES, candidates=None, repeats: int = 20, seed: int = 0) -> dict[int, dict[str, int]]:
    """The fastest candidate for each batch size; candidates that fail to compile or launch are skipped."""
    from kernels.fused_moe import fused_moe_triton  # after the caller has set TRITON_INTERPRET, if it does

    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(device=device, dtype=dtype)
    best: dict[int, dict[str, int]] = {}
    for M in batch_sizes:
        hidden = torch.randn(M, H, generator=gen).to(device=device, dtype=dtype)
        weights, ids = torch.randn(M, E, generator=gen).softmax(-1).topk(top_k, dim=-1)
        ids, weights = ids.to(device), weights.to(device)
        timings = []
        for config in candidates or search_space():
            try:
                ms = time_ms(lambda: fused_moe_triton(hidden, w13, w2, ids, weights, config=config), device, repeats)
            except Exception as err:  # e.g. triton OutOfResources for a tile too big for shared memory
                print(f"M={M} skip {config}: {type(err).__name__}: {err}")
                continue
            timings.append((ms, config))
        if not timings:
            raise RuntimeError(f"no candidate config ran for M={M}")
        ms, best[M] = min(timings, key=lambda pair: pair[0])
        print(f"M={M}: {ms:.4f} ms with {best[M]}")
    return best


def write_configs(table: dict[int, dict[str, int]], E: int, I: int, device_name: str, out_dir: Path,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    path = Path(out_dir) / config_file_name(E, I, device_name, "float32" if dtype == torch.float32 else None)
    path.write_text(json.dumps({str(m): cfg for m, cfg in sorted(table.items())}, indent=4) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, required=True, help="E: experts held by one rank")
    parser.add_argument("--intermediate", type=int, required=True, help="N: intermediate size held by one rank")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=list(BATCH_SIZES))
    parser.add_argument("--quick", action="store_true", help="a 16-config search space instead of 384")
    parser.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.fused_moe is imported
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    table = tune(args.experts, args.intermediate, args.hidden, args.top_k, dtype, device, args.batch_sizes,
                 search_space(args.quick))
    print(f"wrote {write_configs(table, args.experts, args.intermediate, device_name, args.out_dir, dtype)}")


if __name__ == "__main__":
    main()
