"""Tune fused_moe_kernel's launch settings for one MoE shape and write ``configs/E=..,N=..,device_name=...json``.

    python -m kernels.tune_fused_moe --experts 64 --intermediate 1408 --hidden 2048 --top-k 6 --dtype bfloat16 \
        [--batch-sizes 1 2 4 ...] [--budget-s 120] [--json-out tuned.json] [--out-dir kernels/configs | --no-write]

For each candidate config (most promising first) and each batch size it times ``expert_gemms`` alone, the launches
that read expert weights (routing and alignment done once beforehand; CUDA-graph replays, kernels.timing), and keeps
the fastest per batch size, as vLLM's benchmark_moe.py does. The search stops taking new candidates once
``--budget-s`` seconds have passed (compiling a candidate is most of its cost), so it fits a fixed device budget.
The file is merged into an existing one: batch sizes not tuned keep their entries. Without CUDA it runs the
interpreter (--device cpu, TRITON_INTERPRET=1), which only checks the plumbing: its timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from kernels.timing import device_time_ms
from kernels.tuning import CONFIG_DIR, config_file_name, get_config, validate_config

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
# Each axis lists its values in order of preference; candidates are tried by the sum of their values' positions, so
# a budget cuts the least likely ones. Small M wants 16-row tiles and long K strides (decode is weight streaming).
AXES = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (64, 128, 32, 256),
    "BLOCK_SIZE_K": (128, 64, 256),
    "GROUP_SIZE_M": (1, 16),
    "num_warps": (4, 8),
    "num_stages": (3, 4, 5, 2),
}
# Enough different routings per timed call that the expert weights they touch exceed the L2 cache (H200: 60 MB),
# so the figure is a read from device memory, not from L2.
ROTATION_BYTES = 256 * 2**20
MAX_ROTATIONS = 16


def search_space() -> list[dict[str, int]]:
    """Every combination of AXES, the most promising first."""
    ranked = itertools.product(*(list(enumerate(values)) for values in AXES.values()))
    ordered = sorted(ranked, key=lambda combo: (sum(i for i, _ in combo), [i for i, _ in combo]))
    return [dict(zip(AXES, (v for _, v in combo))) for combo in ordered]


def expert_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes of one expert's weights (gate, up and down projections)."""
    return (w13[0].numel() + w2[0].numel()) * w13.element_size()


def rotations(route: Callable[[], tuple[torch.Tensor, torch.Tensor]], bytes_per_expert: int,
              device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Routings (ids, weights), each a fresh ``route()`` draw, until the experts they touch add up to ROTATION_BYTES
    (at most MAX_ROTATIONS; one off CUDA, where there is no L2 to beat)."""
    routings, touched = [], 0
    most = MAX_ROTATIONS if device.type == "cuda" else 1
    while touched < ROTATION_BYTES and len(routings) < most:
        ids, weights = route()
        routings.append((ids.to(device), weights.to(device)))
        touched += ids.unique().numel() * bytes_per_expert
    return routings


def random_router(M: int, E: int, top_k: int, gen: torch.Generator) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Router-like draws for M tokens: top-k of softmaxed random logits (distinct experts per token)."""
    def route() -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.randn(M, E, generator=gen).softmax(-1).topk(top_k, dim=-1)
        return ids, weights
    return route


def time_expert_gemms(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      routings: list[tuple[torch.Tensor, torch.Tensor]], config: dict, repeats: int = 10,
                      replays: int = 5) -> tuple[float, float]:
    """(ms, weight GB/s) of ``expert_gemms`` for one batch with ``config``. The timed call runs it once per routing
    (each aligned beforehand, outside the timing); ms is per routing, and the weight bytes are those of the distinct
    experts each routing touches (each read once), averaged."""
    from kernels.fused_moe import expert_gemms   # after the caller has set TRITON_INTERPRET, if it does
    from kernels.moe_align import moe_align_block_size

    config = validate_config(config)
    E = w13.shape[0]
    cases = []
    for ids, weights in routings:
        aligned = moe_align_block_size(ids, config["BLOCK_SIZE_M"], E)
        out = hidden.new_zeros((ids.numel(), hidden.shape[1]))
        cases.append((weights.reshape(-1).float().contiguous(), aligned, out, ids.shape[1]))

    def run() -> None:
        for weights, aligned, out, top_k in cases:
            expert_gemms(hidden, w13, w2, weights, aligned, top_k, config, True, out)

    ms = device_time_ms(run, hidden.device, repeats, replays) / len(cases)
    touched = sum(ids[ids >= 0].unique().numel() for ids, _ in routings) / len(routings) * expert_bytes(w13, w2)
    return ms, touched / (ms * 1e-3) / 1e9


def tune(E: int, I: int, H: int, top_k: int, dtype: torch.dtype, device: torch.device, batch_sizes=BATCH_SIZES,
         candidates=None, budget_s: float | None = None, repeats: int = 10, seed: int = 0,
         device_name: str = "cpu") -> dict:
    """Time candidates (``search_space()`` order) at every batch size until ``budget_s`` has passed (and one has
    run); candidates that fail to compile or launch (e.g. too much shared memory) are skipped. Returns {"table": {M: best config},
    "timings": {M: {"ms", "weight_gbs", "shipped_ms", "shipped_weight_gbs"}}, "tried", "skipped", "wall_s"}, where
    "shipped" is the config ``get_config`` picks today for (device_name, M), timed the same way."""
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(device=device, dtype=dtype)
    batches = {M: (torch.randn(M, H, generator=gen).to(device=device, dtype=dtype),
                   rotations(random_router(M, E, top_k, gen), expert_bytes(w13, w2), device)) for M in batch_sizes}
    start = time.monotonic()
    dtype_key = "float32" if dtype == torch.float32 else None
    shipped = {M: time_expert_gemms(hidden, w13, w2, routings, get_config(E, I, device_name, M, dtype=dtype_key),
                                    repeats) for M, (hidden, routings) in batches.items()}
    best: dict[int, tuple[float, float, dict]] = {}
    tried = skipped = 0
    for config in candidates if candidates is not None else search_space():
        if best and budget_s is not None and time.monotonic() - start > budget_s:   # at least one config per M
            break
        tried += 1
        try:
            results = {M: time_expert_gemms(hidden, w13, w2, routings, config, repeats)
                       for M, (hidden, routings) in batches.items()}
        except Exception as err:  # e.g. triton OutOfResources for a tile too big for shared memory
            skipped += 1
            print(f"skip {config}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        for M, (ms, gbs) in results.items():
            if M not in best or ms < best[M][0]:
                best[M] = (ms, gbs, config)
    if not best:
        raise RuntimeError(f"no candidate config ran ({tried} tried, {skipped} skipped)")
    timings = {M: {"ms": ms, "weight_gbs": gbs, "shipped_ms": shipped[M][0], "shipped_weight_gbs": shipped[M][1]}
               for M, (ms, gbs, _) in sorted(best.items())}
    for M, t in timings.items():
        print(f"M={M}: {t['ms'] * 1e3:.1f} us, {t['weight_gbs']:.0f} GB/s (shipped config: "
              f"{t['shipped_ms'] * 1e3:.1f} us) with {best[M][2]}")
    return {"table": {M: cfg for M, (_, _, cfg) in sorted(best.items())}, "timings": timings, "tried": tried,
            "skipped": skipped, "wall_s": time.monotonic() - start}


def write_configs(table: dict[int, dict[str, int]], E: int, I: int, device_name: str, out_dir: Path,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Merge ``table`` into the config file for (E, I, device_name, dtype): tuned batch sizes replace their
    entries, the others stay."""
    path = Path(out_dir) / config_file_name(E, I, device_name, "float32" if dtype == torch.float32 else None)
    merged = {int(m): cfg for m, cfg in json.loads(path.read_text()).items()} if path.is_file() else {}
    merged.update(table)
    path.write_text(json.dumps({str(m): cfg for m, cfg in sorted(merged.items())}, indent=4) + "\n")
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
    parser.add_argument("--budget-s", type=float, default=None, help="stop taking new candidates after this long")
    parser.add_argument("--max-configs", type=int, default=None, help="try only the first N candidates")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    parser.add_argument("--no-write", action="store_true", help="do not write the config file")
    parser.add_argument("--json-out", type=Path, help="also write the table and timings here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.fused_moe is imported
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    candidates = search_space()[:args.max_configs] if args.max_configs else None
    result = tune(args.experts, args.intermediate, args.hidden, args.top_k, dtype, device, args.batch_sizes,
                  candidates, args.budget_s, args.repeats, device_name=device_name)
    print(f"{result['tried']} candidates tried ({result['skipped']} skipped) in {result['wall_s']:.0f} s")
    if not args.no_write:
        print(f"wrote {write_configs(result['table'], args.experts, args.intermediate, device_name, args.out_dir, dtype)}")
    if args.json_out:
        shape = {"experts": args.experts, "intermediate": args.intermediate, "hidden": args.hidden,
                 "top_k": args.top_k, "dtype": args.dtype}
        args.json_out.write_text(json.dumps({"shape": shape, "device_name": device_name, **result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
