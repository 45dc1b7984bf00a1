"""Scheduler-only replays: the engine's Scheduler stepped without a model (each sampled token is a constant), so a
step is one batch and time is counted in steps. What the scheduler decides, not how fast a forward runs.

    python experiments/scheduler_fidelity/run.py [--tiny] [--out PATH]

Scenarios (each run under SGLang v0.4's rules, the default, and with engine.alternate_extend_decode=true, servelab's
variant that forces a DECODE step after every EXTEND step while requests decode):
  shared_prefix  the shared_prefix workload (16 groups x 8 prompts, 256-token system prompt per group, 32-token
                 question, 16 output tokens, shuffled) arriving one request per step: radix-cache hit rate =
                 cached prompt tokens / prompt tokens.
  burst          32 prompts of 300 tokens, 64 output tokens each, all at step 0, 512-token chunks: TTFT in steps
                 (p50, max) and the longest decode stall (most steps between two tokens of one request).
Prints one table and writes results.json beside this file (or --out). results_before.json holds the same replays run
against the engine before issue 8 (commit 7f68174).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.engine.config import EngineConfig  # noqa: E402
from framework.engine.kv_pool import KVPool  # noqa: E402
from framework.engine.request import Req, SamplingParams  # noqa: E402
from framework.engine.scheduler import Scheduler  # noqa: E402
from framework.model.tokenizer import ByteTokenizer  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from plugins.workload.shared_prefix import SharedPrefixConfig  # noqa: E402

TOKEN = 7   # what every "forward" samples: never the EOS (requests ignore it anyway)


def replay(cfg: EngineConfig, capacity: int, arrivals: list[tuple[int, Req]]) -> dict:
    """Step the scheduler until every request finished; arrivals: (step, request), sorted by step."""
    sched = Scheduler(cfg, KVPool(1, 1, capacity, torch.float32), eos_id=-1, decode_tail=lambda ids: "")
    token_steps: dict[str, list[int]] = {}
    arrived: dict[str, int] = {}
    pending, step, batches = list(arrivals), 0, {"extend": 0, "decode": 0}
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            at, req = pending.pop(0)
            arrived[req.rid] = at
            sched.add(req)
        batch = sched.next_batch()
        if batch is not None:
            batches[batch.mode.value] += 1
            n = sum(batch.sample)
            for req in sched.process(batch, [TOKEN] * n, float(step)):
                token_steps.setdefault(req.rid, []).append(step)
        step += 1
        if step > 1_000_000:
            raise RuntimeError("replay did not finish")
    reqs = [r for _, r in arrivals]
    ttft = [token_steps[r.rid][0] - arrived[r.rid] + 1 for r in reqs]
    stall = max((b - a for r in reqs for a, b in zip(token_steps[r.rid], token_steps[r.rid][1:])), default=0)
    prompt = sum(len(r.prompt_ids) for r in reqs)
    return {"hit_rate": sum(max(r.cached_tokens, 0) for r in reqs) / prompt, "ttft_p50_steps": statistics.median(ttft),
            "ttft_max_steps": max(ttft), "max_decode_stall_steps": stall, "steps": step,
            "extend_steps": batches["extend"], "decode_steps": batches["decode"]}


def shared_prefix_arrivals(tiny: bool) -> list[tuple[int, Req]]:
    wcfg = SharedPrefixConfig(num_groups=4 if tiny else 16, prompts_per_group=4 if tiny else 8)
    tok = ByteTokenizer(260)
    sessions = WORKLOAD.build("shared_prefix", wcfg, 0).sessions()
    return [(i, Req(tok.encode(s.prompt(0, [])), SamplingParams(max_new_tokens=s.turns[0].max_new_tokens,
                                                                 ignore_eos=True)))
            for i, s in enumerate(sessions)]


def burst_arrivals(tiny: bool) -> list[tuple[int, Req]]:
    rng = random.Random(0)
    n, length = (8, 200) if tiny else (32, 300)
    return [(0, Req([rng.randrange(256) for _ in range(length)], SamplingParams(max_new_tokens=64, ignore_eos=True)))
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="smaller scenarios (the smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = ap.parse_args()
    base = EngineConfig(chunked_prefill_tokens=512)
    variants = {"sglang": base, "alternate_extend_decode": dataclasses.replace(base, alternate_extend_decode=True)}
    scenarios = {"shared_prefix": shared_prefix_arrivals, "burst": burst_arrivals}
    rows = []
    print("scheduler-only replay (a step = one batch; no model): SGLang v0.4 rules vs servelab's alternation switch")
    print(f"{'scenario':<14} {'variant':<24} {'hit rate':>8} {'TTFT p50':>9} {'TTFT max':>9} {'max stall':>10} "
          f"{'steps':>6} {'extend':>7} {'decode':>7}")
    for scenario, make in scenarios.items():
        for variant, cfg in variants.items():
            r = {"scenario": scenario, "variant": variant, **replay(cfg, 1 << 20, make(args.tiny))}
            rows.append(r)
            print(f"{scenario:<14} {variant:<24} {r['hit_rate']:>8.3f} {r['ttft_p50_steps']:>9.1f} "
                  f"{r['ttft_max_steps']:>9d} {r['max_decode_stall_steps']:>10d} {r['steps']:>6d} "
                  f"{r['extend_steps']:>7d} {r['decode_steps']:>7d}")
    Path(args.out).write_text(json.dumps({"tiny": args.tiny, "rows": rows}, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
