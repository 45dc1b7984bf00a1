"""Does vLLM's own scheduler (round 3, engine.scheduler=vllm_v0_1_7) decide differently from round 2's SGLang-v0.4
stand-in on the pd_repro workload? Runs the vLLM baseline of predict.py --round 2 and --round 3 at a few per-GPU
rates, records every step of each (mode, requests, extend lengths, preemptions), and prints whether the two step
sequences are equal, with what could have made them differ: the KV pool's peak, preemptions, the most requests
running and the largest prefill batch. Writes scheduler_check.json beside this file (about 30 s).

    python experiments/pd_repro/scheduler_check.py [--rates 1.5 2.125 4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from predict import distserve_dataset, run_sim, vllm_instance  # noqa: E402


def steps(sharegpt: str, rate: float, rnd: int) -> tuple[list, dict]:
    cfg, sessions, inst = vllm_instance(sharegpt, 0, rate, rnd)
    group = next(iter(inst.values())).groups[0]
    group.step_log, peak = [], [0]
    form = group.next_batch

    def next_batch():                         # the pool's use once each batch is formed (slots taken)
        batch = form()
        peak[0] = max(peak[0], group.pool.used())
        return batch

    group.next_batch = next_batch
    res = run_sim(inst, cfg, sessions, None, {}, rnd)
    log = [(r.mode, r.rids, r.extend_lens, r.retracted) for r in group.step_log]
    extends = [len(r[1]) for r in log if r[0] == "extend"]
    return log, {"slo_attainment": res["slo_attainment"], "steps": len(log), "peak_kv_tokens": peak[0],
                 "kv_pool_tokens": group.pool.capacity, "preemptions": group.stats["retractions"],
                 "max_running": group.stats["max_running_requests"], "largest_prefill_batch": max(extends)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", type=float, nargs="+", default=[1.5, 2.125, 4.0])
    args = ap.parse_args()
    sharegpt, _ = distserve_dataset(None, seed=0)
    rows = []
    print(f"{'req/s/GPU':>9} {'scheduler':>12} {'same steps':>10} {'steps':>6} {'peak KV / pool':>16} {'preempted':>9} "
          f"{'max running':>11} {'max prefill batch':>17}")
    for rate in args.rates:
        (log2, r2), (log3, r3) = steps(sharegpt, rate, 2), steps(sharegpt, rate, 3)
        row = {"rate_per_gpu": rate, "same_steps": log2 == log3, "round2_sglang": r2, "round3_vllm": r3}
        rows.append(row)
        for name, r in (("sglang (r2)", r2), ("vllm (r3)", r3)):
            print(f"{rate:>9.3f} {name:>12} {str(row['same_steps']):>10} {r['steps']:>6} "
                  f"{r['peak_kv_tokens']:>7} / {r['kv_pool_tokens']:<6} {r['preemptions']:>9} {r['max_running']:>11} "
                  f"{r['largest_prefill_batch']:>17}")
    (HERE / "scheduler_check.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
