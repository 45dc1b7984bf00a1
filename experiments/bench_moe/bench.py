"""Tokens/s of one MoE layer step for each backend and dispatch form, by batch size, at one rank and at two.

A step is what the model does around the routed experts: router (gate matmul + select_experts), the backend, and the
token-layout conversion the parallelism plugin makes under DP attention (the design these backends serve): a layout
"all" backend gets every rank's tokens gathered before and its rows handed back after (reduce-scatter when partial);
ep's all_to_all ("local") routes and ships only its own tokens. The instance's batch of B tokens is split evenly over
the ranks; tokens/s = B / (median over repeats of the slowest rank's step time); repeats interleave the backends.
Shared experts are left out (the same work for every backend).

Shapes: the default tiny model's layer (8 experts, top-2, hidden 128, intermediate 64, group-limited v2 gating) and a
DeepSeek-V2-Lite-like layer (64 experts, top-6, hidden 2048, intermediate 1408) with hidden and intermediate divided
by --v2lite-scale (4 by default: fits a 2-core CPU in minutes; 1 on a GPU). Size 2 needs two GPUs, else it runs on
CPU with gloo.

The fused kernel alone, at decode sizes (<= 64 tokens), wherever the Triton kernel runs (CUDA, or the interpreter
under TRITON_INTERPRET=1, which checks only the plumbing): routing and alignment are done once, then the launches
that read expert weights (kernels.fused_moe.expert_gemms) are timed as CUDA-graph replays (kernels.timing), over
enough different routings that their weights exceed the L2 cache. Weight bandwidth = bytes of the experts each routing
touches / that time, against --peak-gbs (H200: 4800 GB/s). On CUDA each step's host syncs are counted too.

    python experiments/bench_moe/bench.py [--batch-sizes 1,4,16,64,256,512 --sizes 1,2 --budget-s 0.25 --runs 3]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from framework.dist import Group, launch
from framework.model.gating import select_experts
from framework.contracts.moe import count_host_syncs
from plugins.moe.reference import ReferenceConfig
from framework.core.registry import MOE
from kernels.tune_fused_moe import expert_bytes, rotations, time_expert_gemms
from kernels.tuning import get_config
from plugins.moe.ep import EPConfig
from plugins.moe.triton_fused import TritonFusedConfig

OUT = Path(__file__).with_name("results.json")
BACKENDS = {"reference": ReferenceConfig(), "triton_fused": TritonFusedConfig(), "ep_all_to_all": EPConfig(),
            "ep_all_reduce": EPConfig(dispatch="all_reduce")}
TINY = dict(experts=8, top_k=2, hidden=128, inter=64, n_group=4, topk_group=2)


def v2lite(scale: int) -> dict:
    return dict(experts=64, top_k=6, hidden=2048 // scale, inter=1408 // scale, n_group=1, topk_group=1)


def make_layer(shape: dict, device, dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    layer = {"gate": torch.randn(e, h, generator=gen) / h**0.5, "w13": torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
             "w2": torch.randn(e, h, i, generator=gen) / i**0.5}
    return {k: v.to(device=device, dtype=dtype) for k, v in layer.items()}


def route_tokens(x: torch.Tensor, gate: torch.Tensor, shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = select_experts(x @ gate.t(), top_k=shape["top_k"], n_group=shape["n_group"],
                                  topk_group=shape["topk_group"], gating="v2", routed_scaling_factor=1.0,
                                  norm_topk_prob=False)
    return ids, weights.to(x.dtype)


def moe_step(backend, group: Group, gate, own: torch.Tensor, counts: list[int], shape: dict) -> torch.Tensor:
    """One MoE layer on this rank's tokens, with the DP-attention layout conversion the backend asks for."""
    if backend.token_layout == "local":
        return backend.forward(own, *route_tokens(own, gate, shape))
    x = group.all_gather_uneven(own, counts)   # counts are known: the DP-attention step sync exchanged them
    out = backend.forward(x, *route_tokens(x, gate, shape))
    if backend.partial:
        return group.reduce_scatter_uneven(out, counts)
    start = sum(counts[:group.rank])
    return out[start:start + counts[group.rank]]


def time_backends(steps: dict, group: Group, device, budget_s: float) -> dict[str, float]:
    """Median over rounds of the slowest rank's time for each step function. Rounds interleave the backends, so a
    burst of load from other processes on a shared machine hits all of them alike; the round count is rank 0's."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():   # warm-up (Triton compiles on its first call)
        step()
        step()
    sync()
    t0 = time.perf_counter()
    for step in steps.values():
        step()
    sync()
    one_round = max(time.perf_counter() - t0, 1e-6)
    rounds = group.broadcast_object(max(3, min(50, int(budget_s * len(steps) / one_round))))
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            group.barrier()
            t0 = time.perf_counter()
            step()
            sync()
            times[key].append(time.perf_counter() - t0)
    per_rank = group.all_gather_object(times)
    return {key: statistics.median(max(rep) for rep in zip(*(r[key] for r in per_rank))) for key in steps}


def kernel_runs(device: torch.device) -> bool:
    """Whether the compiled (CUDA) or interpreted Triton kernel can run here."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.fused_moe import fused_moe_kernel
    return device.type == "cuda" or isinstance(fused_moe_kernel, InterpretedFunction)


def kernel_figures(backend, gate: torch.Tensor, shape: dict, batch: int, device, dtype, peak_gbs: float) -> dict:
    """The fused kernel alone on this rank's weights (``backend``: the triton_fused backend) for ``batch`` tokens
    routed by the layer's gate; batches of fresh tokens rotate until their experts exceed the L2 cache."""
    gen = torch.Generator().manual_seed(batch)

    def route():
        x = torch.randn(batch, shape["hidden"], generator=gen).to(device=device, dtype=dtype)
        return route_tokens(x, gate, shape)

    hidden = torch.randn(batch, shape["hidden"], generator=gen).to(device=device, dtype=dtype)
    routings = rotations(route, expert_bytes(backend.w13, backend.w2), device)
    config = get_config(backend.w13.shape[0], backend.w2.shape[-1], backend.device_name, batch,
                        dtype="float32" if dtype == torch.float32 else None)
    ms, gbs = time_expert_gemms(hidden, backend.w13, backend.w2, routings, config,
                                repeats=10 if device.type == "cuda" else 1)   # the interpreter is slow
    return {"kernel_us": ms * 1e3, "weight_gbs": gbs, "peak_bw_frac": gbs / peak_gbs, "kernel_config": config}


def bench_rank(group: Group, shapes: dict, batch_sizes: list[int], budget_s: float, dtype: str,
               peak_gbs: float) -> list[dict]:
    torch.set_num_threads(1)
    device = group.device if group.size > 1 else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, dtype if dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"))
    records = []
    for shape_name, shape in shapes.items():
        layer = make_layer(shape, device, dtype)
        backends = {k: MOE.build(c.name, c, layer["w13"], layer["w2"], group) for k, c in BACKENDS.items()}
        for batch in batch_sizes:
            tokens = torch.randn(batch, shape["hidden"], generator=torch.Generator().manual_seed(batch))
            tokens = tokens.to(device=device, dtype=dtype)
            counts = [batch // group.size + (r < batch % group.size) for r in range(group.size)]
            own = tokens[sum(counts[:group.rank]):sum(counts[:group.rank + 1])]
            steps = {key: functools.partial(moe_step, backend, group, layer["gate"], own, counts, shape)
                     for key, backend in backends.items()}
            for key, step_s in time_backends(steps, group, device, budget_s).items():
                rec = {"shape": shape_name, "ranks": group.size, "device": str(device.type), "dtype": str(dtype),
                       "backend": key, "batch_tokens": batch, "step_ms": step_s * 1e3, "tok_s": batch / step_s}
                if device.type == "cuda":
                    rec["host_syncs"] = count_host_syncs(steps[key])
                if key == "triton_fused" and batch <= 64 and kernel_runs(device):
                    rec.update(kernel_figures(backends[key], layer["gate"], shape, batch, device, dtype, peak_gbs))
                records.append(rec)
    return records


def median_over_runs(runs: list[list[dict]]) -> list[dict]:
    """Each cell's record from the run with the median step time (whole sweeps repeated, so a burst of load from
    other processes spoils one run of a cell, not the figure); every run's time is kept in step_ms_runs."""
    out = []
    for cells in zip(*runs):
        ordered = sorted(cells, key=lambda r: r["step_ms"])
        out.append({**ordered[len(ordered) // 2], "step_ms_runs": [r["step_ms"] for r in cells]})
    return out


def add_ratios(records: list[dict]) -> None:
    ref = {(r["shape"], r["ranks"], r["batch_tokens"]): r["tok_s"] for r in records if r["backend"] == "reference"}
    for r in records:
        r["ratio_vs_reference"] = r["tok_s"] / ref[(r["shape"], r["ranks"], r["batch_tokens"])]


def table(records: list[dict], batch_sizes: list[int]) -> str:
    head = f"{'shape':<12}{'ranks':>5}  {'backend':<14}" + "".join(f"{f'B={b}':>17}" for b in batch_sizes)
    lines = [head, "-" * len(head)]
    rows: dict[tuple, dict[int, dict]] = {}
    for r in records:
        rows.setdefault((r["shape"], r["ranks"], r["backend"]), {})[r["batch_tokens"]] = r
    for (shape, ranks, backend), by_batch in rows.items():
        cells = "".join(f"{by_batch[b]['tok_s']:>10,.0f} {by_batch[b]['ratio_vs_reference']:>5.2f}x"
                        for b in batch_sizes)
        lines.append(f"{shape:<12}{ranks:>5}  {backend:<14}{cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64,256,512")
    ap.add_argument("--sizes", default="1,2", help="instance sizes (ranks); >1 is spawned on gloo (NCCL with GPUs)")
    ap.add_argument("--shapes", default="tiny,v2lite")
    ap.add_argument("--v2lite-scale", type=int, default=4, help="divide V2-Lite's hidden and intermediate by this")
    ap.add_argument("--budget-s", type=float, default=0.25, help="seconds per backend and batch size (3..50 repeats)")
    ap.add_argument("--runs", type=int, default=3, help="repeat the whole sweep; each cell reports its median run")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the GPU's peak memory bandwidth (H200: 4800)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    all_shapes = {"tiny": TINY, f"v2lite/{args.v2lite_scale}": v2lite(args.v2lite_scale)}
    shapes = {k: v for k, v in all_shapes.items() if k.split("/")[0] in args.shapes.split(",")}
    torch.set_num_threads(1)
    start = time.time()
    runs = []
    for _ in range(args.runs):
        run = []
        for size in (int(s) for s in args.sizes.split(",")):
            run_args = (shapes, batch_sizes, args.budget_s, args.dtype, args.peak_gbs)
            if size == 1:
                run += bench_rank(Group(), *run_args)
            else:
                gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
                run += launch(bench_rank, size, *run_args, backend="nccl" if gpus >= size else "gloo",
                              timeout_s=120)[0]
        runs.append(run)
    records = median_over_runs(runs)
    add_ratios(records)
    print(f"MoE layer step, tokens/s and ratio vs reference (DP-attention layout, {os.cpu_count()} cores, "
          f"1 torch thread per rank, median of {args.runs} runs)")
    print(table(records, batch_sizes))
    for r in records:
        if "peak_bw_frac" in r:
            print(f"fused kernel alone, {r['shape']} x{r['ranks']} B={r['batch_tokens']}: {r['kernel_us']:.1f} us, "
                  f"weights {r['weight_gbs']:.0f} GB/s = {r['peak_bw_frac']:.1%} of {args.peak_gbs:.0f} GB/s")
    syncs: dict[tuple, set] = {}
    for r in records:
        if "host_syncs" in r:
            syncs.setdefault((r["shape"], r["ranks"], r["backend"]), set()).add(r["host_syncs"])
    for (shape, ranks, backend), counts in syncs.items():
        print(f"host syncs per step, {shape} x{ranks} {backend}: {'/'.join(map(str, sorted(counts)))}")
    meta = {"shapes": shapes, "batch_sizes": batch_sizes, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "machine": platform.machine(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "wall_s": time.time() - start, "date": time.strftime("%Y-%m-%d"),
            "load_average_1m_at_end": os.getloadavg()[0]}
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
