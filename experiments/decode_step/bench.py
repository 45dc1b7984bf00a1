"""Decode step time of the default model on one rank, by batch size, and how much of a step is the scheduler.

    python experiments/decode_step/bench.py [--batches 1 8 32 64] [--context 256] [--repeats 5]
                                            [--device cpu|cuda] [--moe reference|triton_fused|ep]

For each batch size: fill the batch with requests of `context` prompt tokens, then time decode steps; the median
over repeats of the median step. "scheduler" is everything in Engine.step outside the model forward (batch
formation, KV bookkeeping, sampling, result processing). Prints a table and writes results.json beside this file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.model.config import ModelConfig
from framework.parallel import Parallelism, ParallelConfig
from framework.registry import MOE


def time_batch(batch: int, context: int, steps: int, seed: int, device: str = "cpu",
               moe: str = "reference") -> tuple[float, float, float]:
    engine = Engine(ModelConfig(), EngineConfig(kv_budget_mb=256, device=device),
                    Parallelism(ParallelConfig(), Group()), MOE.get(moe).Config(), seed)
    for i in range(batch):
        prompt = [(i * 7 + j) % 256 for j in range(context)]
        engine.add(Req(prompt, SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)))
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    engine.step()
    step_s, fwd_s = [], []
    for _ in range(steps):
        f0, t0 = engine.timing["forward_s"], time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        fwd_s.append(engine.timing["forward_s"] - f0)
    step, fwd = statistics.median(step_s), statistics.median(fwd_s)
    return step * 1e3, fwd * 1e3, (step - fwd) / step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--moe", default="reference", choices=MOE.keys())
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"decode step, model=tiny_mla_moe, moe={args.moe}, {args.device}, context {args.context} tokens, "
          f"{args.threads} thread(s), median of {args.repeats} runs x {args.steps} steps")
    print(f"{'batch':>6} {'step ms':>9} {'forward ms':>11} {'scheduler %':>12} {'tok/s':>9}")
    for b in args.batches:
        runs = [time_batch(b, args.context, args.steps, r, args.device, args.moe) for r in range(args.repeats)]
        step = statistics.median(r[0] for r in runs)
        fwd = statistics.median(r[1] for r in runs)
        sched = statistics.median(r[2] for r in runs)
        rows.append({"batch": b, "step_ms": step, "forward_ms": fwd, "scheduler_frac": sched,
                     "decode_tok_s": b / step * 1e3})
        print(f"{b:>6} {step:>9.2f} {fwd:>11.2f} {sched * 100:>11.1f}% {b / step * 1e3:>9.0f}")
    meta = {"context_tokens": args.context, "threads": args.threads, "device": args.device, "moe": args.moe,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
