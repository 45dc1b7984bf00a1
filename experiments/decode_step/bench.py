"""Decode step time of the default model on one rank, by batch size and context, and how much of a step is
bookkeeping (everything but the model's layers), with and without CUDA graphs.

    python experiments/decode_step/bench.py [--batches 1 8 32 64 256] [--contexts 256 2048] [--steps 10]
        [--repeats 3] [--device cpu|cuda] [--moe reference|triton_fused|ep] [--cuda-graph on|off|both]
        [--cuda-graph-max-bs N] [--compare results_before.json]

For each batch size and context: fill the batch with requests of `context` prompt tokens, then time decode steps;
the median over repeats of the median step. "bookkeeping" is everything in Engine.step but the model's layers (batch
formation, KV slot writes, building the attention index from the req_to_token table: one gather per step, timed on
its own; sampling, result processing), the median over steps of (step - model call) plus that index; "forward" is
the rest of the step. Prints a table, writes results.json
beside this file. --compare adds the bookkeeping share from an earlier results.json (the same sizes) as "before".
--cuda-graph (default: both on CUDA, off on a CPU, which has no graphs) sets engine.cuda_graph; each row counts the
timed steps that replayed a graph and those that ran eagerly. A graph's decode attention reads a fixed number of
slots (engine.cuda_graph_max_context): the bench sets it to the context plus the tokens decoded, so every timed step
can replay. A batch above --cuda-graph-max-bs (default SGLang's 160) runs eagerly.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.dist.group import Group  # noqa: E402
from framework.engine.config import EngineConfig  # noqa: E402
from framework.engine.engine import Engine  # noqa: E402
from framework.engine.request import Req, SamplingParams  # noqa: E402
from framework.model.attention import attention_metadata  # noqa: E402
from framework.model.config import ModelConfig  # noqa: E402
from framework.contracts.parallel import Parallelism, ParallelConfig  # noqa: E402
from framework.core.registry import MOE  # noqa: E402


def time_batch(batch: int, context: int, steps: int, seed: int, device: str, moe: str = "reference",
               cuda_graph: bool = False, cuda_graph_max_bs: int | None = None) -> dict:
    model = ModelConfig()
    max_new = 2 * steps + 4 + -(-batch * context // 8192)    # never finishes while the batch fills and is timed
    tokens = batch * (context + max_new)
    engine_cfg = EngineConfig(kv_budget_mb=tokens * model.kv_bytes_per_token() / 2**20 + 1,
                              chunked_prefill_tokens=8192, max_running_requests=max(batch, 1), device=device,
                              cuda_graph=cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs,
                              cuda_graph_max_context=context + max_new)
    engine = Engine(model, engine_cfg, Parallelism(ParallelConfig(), Group()), MOE.get(moe).Config(), seed)
    for i in range(batch):
        prompt = [(i * 7 + j) % 256 for j in range(context)]
        engine.add(Req(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    engine.step()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    step_s, fwd_s, index_s = [], [], []
    before = dict(engine.graphs.stats)
    for _ in range(steps):
        sync()
        f0, t0 = engine.timing["forward_s"], time.perf_counter()
        engine.step()
        sync()
        step_s.append(time.perf_counter() - t0)
        fwd_s.append(engine.timing["forward_s"] - f0)
    sched = engine.scheduler
    replayed = engine.graphs.stats["graph_replayed_steps"] - before["graph_replayed_steps"]
    assert len(sched.running) == batch, "the batch did not fit: raise the KV budget"
    for _ in range(steps):             # the index build alone, on a decode batch of the same shape
        batch_obj = sched.next_batch()
        batch_obj.to(engine.device)
        sync()
        t0 = time.perf_counter()
        attention_metadata(batch_obj)
        sync()
        index_s.append(time.perf_counter() - t0)
        sched.process(batch_obj, [0] * batch, 0.0)
    step, index = statistics.median(step_s), statistics.median(index_s)
    outside = statistics.median(s - f for s, f in zip(step_s, fwd_s))   # per step: robust to a preempted step
    return {"step_ms": step * 1e3, "forward_ms": (step - outside - index) * 1e3, "index_ms": index * 1e3,
            "bookkeeping_ms": (outside + index) * 1e3, "bookkeeping_frac": (outside + index) / step,
            "graph_replayed_steps": replayed, "graph_eager_steps": steps - replayed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--moe", default="reference", choices=MOE.keys())
    ap.add_argument("--cuda-graph", choices=("on", "off", "both"), help="engine.cuda_graph (default: both on CUDA, "
                    "off on a CPU)")
    ap.add_argument("--cuda-graph-max-bs", type=int, help="engine.cuda_graph_max_bs (default: SGLang's 160)")
    ap.add_argument("--compare", help="an earlier results.json: its bookkeeping share is printed as 'before'")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = ap.parse_args()
    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[
        args.cuda_graph or ("both" if args.device == "cuda" else "off")]
    torch.set_num_threads(args.threads)
    before = {}
    if args.compare:
        before = {(r["batch"], r["context"]): r["bookkeeping_frac"] for r in json.loads(Path(args.compare).read_text())["rows"]}
    rows = []
    print(f"decode step, model=tiny_mla_moe, moe={args.moe}, {args.device}, {args.threads} thread(s), median of "
          f"{args.repeats} runs x {args.steps} steps" + (f"; before: {args.compare}" if before else "")
          + f"; cuda_graph_max_bs={args.cuda_graph_max_bs or 'SGLang default'}")
    print(f"{'batch':>6} {'context':>8} {'graph':>6} {'step ms':>9} {'forward ms':>11} {'index ms':>9} "
          f"{'bookkeeping ms':>15} {'share':>6} {'before':>7} {'tok/s':>9} {'replayed/eager':>15}")
    for context in args.contexts:
        for b in args.batches:
            for graph in graph_modes:
                runs = [time_batch(b, context, args.steps, seed=r, device=args.device, moe=args.moe,
                                   cuda_graph=graph, cuda_graph_max_bs=args.cuda_graph_max_bs)
                        for r in range(args.repeats)]
                row = {"batch": b, "context": context, "cuda_graph": graph,
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                row["decode_tok_s"] = b / row["step_ms"] * 1e3
                rows.append(row)
                was = before.get((b, context))
                counts = f"{row['graph_replayed_steps']:.0f}/{row['graph_eager_steps']:.0f}"
                print(f"{b:>6} {context:>8} {'on' if graph else 'off':>6} {row['step_ms']:>9.2f} "
                      f"{row['forward_ms']:>11.2f} {row['index_ms']:>9.3f} {row['bookkeeping_ms']:>15.3f} "
                      f"{row['bookkeeping_frac'] * 100:>5.1f}% {'' if was is None else f'{was * 100:.1f}%':>7} "
                      f"{row['decode_tok_s']:>9.0f} {counts:>15}", flush=True)
    meta = {"device": args.device, "moe": args.moe, "threads": args.threads, "steps": args.steps,
            "repeats": args.repeats, "cuda_graph_max_bs": args.cuda_graph_max_bs, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
