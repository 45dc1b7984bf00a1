"""The real half of the P/D study (issue 20, item 7): prefill:decode ratio x disaggregation decider x routing policy on
the Mooncake conversation trace, on this machine's 4 CPU workers behind servelab's router, goodput at a stated SLO.

Setup: workload=trace (the conversation trace, scaled to a CPU as conf/workload/trace.yaml says: 16-character blocks
for the trace's 512 tokens, answers 1/16 as long and at most 32 tokens), its first --requests requests at its own
timestamps played --time-scale times as fast (default 0.25: 0.85 requests a second, below what the P/D cells' prefill
side serves here; at 1, the trace's own clock of 3.4 a second, the prefill workers fell behind and the P/D cells
measured a backlog, not a design); the tiny CPU model on 4 workers
(engine.device=cpu, engine.kv_budget_mb=6 each: room for the longest of these prompts, 3,770 characters). Cells:

- P:D: 4 mixed workers (the baseline), 2:2 and 3:1 prefill:decode (cluster.roles; decode workers with
  engine.disaggregation_local_prefill=true so a decider can keep a request local). At CPU scale the trace is
  prefill-heavy (prompts 463 characters on average, answers at most 32 tokens): 1:3 (`--ratios ... 1:3`) starved its
  one prefill worker (a first run: goodput 0.11-0.12 req/s, TTFT p50 8-11 s, 22 requests timed out waiting for KV);
- decider: always (sglang-router's P/D mode), decode_first@128 (llm-d's rule: a remote prefill only above 128
  uncached tokens, the study's 4096 trace tokens at 1/32 scale);
- policy: round_robin, cache_aware (one instance per role: router.prefill_policy/decode_policy default).

SLO: TTFT <= 1500 ms and TPOT <= 150 ms (pd_side_by_side's CPU SLO, set before this ran). Goodput: requests meeting
both per second of the run. One set of workers per P:D ratio; within it, one router process per cell after every
cache is flushed, repeats interleaved (experiments/router_ablation/loop.py). The machine is 2 shared cores with other
work on them: absolute figures are this machine's, and only large gaps mean anything.

    python experiments/pd_study/real.py [--requests 120] [--time-scale 0.25] [--ratios mixed 2:2 3:1] [--quick]
        # results-real.json, table-real.md, plots/goodput-real.png (32 min here at --time-scale 0.25)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments" / "router_ablation"))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from loop import Cell, median_run, run_cells, table, with_workers  # noqa: E402

WORKERS = 4
SLO = ["workload.slo.ttft_ms=1500", "workload.slo.tpot_ms=150"]
RATIOS = {"mixed": None, "1:3": 1, "2:2": 2, "3:1": 3}
DEFAULT_RATIOS = ("mixed", "2:2", "3:1")   # 1:3 starves prefill here: the CPU-scaled trace is prefill-heavy
DECIDERS = {"always": ["router.pd_decider=always"],
            "decode_first@128": ["router.pd_decider=decode_first", "router.pd_local_prefill_max_tokens=128"]}
POLICIES = ("round_robin", "cache_aware")
COMMON = [f"cluster.instances={WORKERS}", "engine.device=cpu", "engine.kv_budget_mb=6", "cluster.restart_workers=false",
          "logger.mode=disabled", "router.control_plane_audit_enabled=false", "seed=0", "workload=trace",
          "workload.sample_interval_s=0", *SLO]
COLS = [("P:D", "pd", "{}"), ("decider", "decider", "{}"), ("policy", "policy", "{}"),
        ("goodput req/s", "goodput_req_s", "{:.2f}"), ("SLO met", "slo_attainment", "{:.2f}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
        ("TPOT p90 ms", "tpot_p90_ms", "{:.1f}"), ("hit rate", "cache_hit_rate", "{:.3f}"),
        ("paired", "paired_fraction", "{:.2f}"), ("failed", "requests_failed", "{}")]


def ratio_overrides(prefill: int | None) -> list[str]:
    if prefill is None:
        return []
    roles = ["prefill"] * prefill + ["decode"] * (WORKERS - prefill)
    return [f"cluster.roles=[{','.join(roles)}]", "engine.disaggregation_local_prefill=true"]


def paired(results: dict, records: list) -> dict:
    n = sum(1 for r in records if r.ok and r.kv_transfer_bytes > 0)
    return {"paired_fraction": n / max(results["requests_completed"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="replay speed of the trace's clock (1: its own, 3.4 requests a second)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ratios", nargs="+", default=list(DEFAULT_RATIOS), choices=list(RATIOS))
    ap.add_argument("--quick", action="store_true", help="12 requests, round_robin only (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = 12 if args.quick else args.requests
    base = COMMON + [f"workload.num_requests={n}", f"workload.time_scale={args.time_scale:g}"]
    policies = POLICIES[:1] if args.quick else POLICIES
    t0, runs, trials = time.time(), [], []
    for ratio in args.ratios:
        prefill = RATIOS[ratio]
        extra = base + ratio_overrides(prefill)
        cells = {}
        for policy in policies:
            for decider, d in (DECIDERS.items() if prefill else [("-", [])]):
                cfg = compose(extra + [f"router={policy}", *d])
                cells[policy, decider] = Cell(cfg.router, cfg, {"pd": ratio, "decider": decider, "policy": policy})
        got = with_workers(cells[next(iter(cells))].run,
                           lambda cluster: run_cells(cluster, cells, args.repeats, extra=paired))
        runs += [median_run(ts) for ts in got.values()]
        trials += [t for ts in got.values() for t in ts]
    text = table(COLS, runs, text_cols=3)
    print(text)
    out = {"experiment": "pd_study_real", "git_sha": git_sha(), "wall_s": time.time() - t0, "repeats": args.repeats,
           "requests": n, "time_scale": args.time_scale, "slo": SLO, "overrides": base, "runs": runs,
           "trials": trials}
    if args.quick:
        print(f"(a smoke run: nothing written; {out['wall_s']:.0f} s)")
        return
    (HERE / "results-real.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (HERE / "table-real.md").write_text(text + "\n")
    plot(runs, [r for r in args.ratios if r != "mixed"])
    print(f"results: {HERE / 'results-real.json'}  ({out['wall_s']:.0f} s)")


def plot(runs: list[dict], ratios: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    (HERE / "plots").mkdir(exist_ok=True)
    fig, axes = plt.subplots(1, len(POLICIES), figsize=(11, 4), squeeze=False, layout="constrained")
    for ax, policy in zip(axes[0], POLICIES):
        mine = [r for r in runs if r["policy"] == policy]
        if not mine:
            continue
        mixed = next(r["goodput_req_s"] for r in mine if r["pd"] == "mixed")
        for j, decider in enumerate(DECIDERS):
            ys = [next(r["goodput_req_s"] for r in mine if r["pd"] == k and r["decider"] == decider) for k in ratios]
            ax.bar([i + (j - 0.5) * 0.35 for i in range(len(ratios))], ys, 0.35, label=decider)
        ax.axhline(mixed, color="k", ls="--", label=f"{WORKERS} mixed")
        ax.set_xticks(range(len(ratios)), ratios)
        ax.set_xlabel("prefill:decode workers")
        ax.set_ylabel("goodput (req/s, TTFT <= 1.5 s, TPOT <= 150 ms)")
        ax.set_title(f"router={policy}")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.suptitle(f"Mooncake conversation trace (CPU scale), {WORKERS} CPU workers on this 2-core machine")
    fig.savefig(HERE / "plots" / "goodput-real.png", dpi=120)


if __name__ == "__main__":
    main()
