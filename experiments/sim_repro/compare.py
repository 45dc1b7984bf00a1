"""Issue 19, item 8: a pre-registered prediction (predict.py's predictions_round<N>.json, committed first) beside
the published figures, which live only here. Prints published vs predicted, the error, and pass/fail against the
targets: each cell within 20%, the DP/TP decode and prefill ratios within 15% (the cache-aware / round-robin ratio
is shown, not judged). Writes comparison_round<N>.json beside the predictions.

    python experiments/sim_repro/compare.py experiments/sim_repro/predictions_round1.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# SGLang PR #1970's description (8 x H100, neuralmagic/DeepSeek-Coder-V2-Instruct-FP8, bench_serving random,
# 10,000 prompts) and PR #2170's table (8 x A100, dp-size 8 behind the router, generated-shared-prefix defaults)
PUBLISHED = {"pr1970/decode/tp": 6656.75, "pr1970/decode/dp_attn": 11174.62,
             "pr1970/prefill/tp": 17941.92, "pr1970/prefill/dp_attn": 21658.78,
             "pr2170/round_robin": 82665.0, "pr2170/cache_aware": 158596.72}
RATIOS = {"pr1970/decode dp_attn / tp": ("pr1970/decode/dp_attn", "pr1970/decode/tp", 0.15),
          "pr1970/prefill dp_attn / tp": ("pr1970/prefill/dp_attn", "pr1970/prefill/tp", 0.15),
          "pr2170/cache_aware / round_robin": ("pr2170/cache_aware", "pr2170/round_robin", None)}
CELL_TARGET = 0.20


def compare(pred: dict) -> dict:
    figures = {cell: p["figure"] for cell, p in pred["predictions"].items()}
    missing = sorted(set(PUBLISHED) - set(figures))
    if missing:
        raise SystemExit(f"the predictions file has no figure for {', '.join(missing)}")
    cells = [{"cell": c, "published": pub, "predicted": figures[c], "error": figures[c] / pub - 1,
              "target": CELL_TARGET, "pass": abs(figures[c] / pub - 1) <= CELL_TARGET} for c, pub in PUBLISHED.items()]
    ratios = []
    for name, (num, den, target) in RATIOS.items():
        pub, got = PUBLISHED[num] / PUBLISHED[den], figures[num] / figures[den]
        ratios.append({"ratio": name, "published": pub, "predicted": got, "error": got / pub - 1, "target": target,
                       "pass": None if target is None else abs(got / pub - 1) <= target})
    return {"round": pred.get("round"), "prediction_git_sha": pred.get("git_sha"), "cells": cells, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predictions", type=Path)
    args = ap.parse_args()
    pred = json.loads(args.predictions.read_text())
    out = compare(pred)
    print(f"round {out['round']} (prediction at {out['prediction_git_sha']})\n")
    print("| cell | published | predicted | error | target | pass |\n|---|---:|---:|---:|---:|---|")
    for c in out["cells"]:
        print(f"| {c['cell']} | {c['published']:,.0f} | {c['predicted']:,.0f} | {c['error']:+.1%} | "
              f"{c['target']:.0%} | {'yes' if c['pass'] else 'NO'} |")
    print("\n| ratio | published | predicted | error | target | pass |\n|---|---:|---:|---:|---:|---|")
    for r in out["ratios"]:
        target = "-" if r["target"] is None else f"{r['target']:.0%}"
        verdict = "-" if r["pass"] is None else "yes" if r["pass"] else "NO"
        print(f"| {r['ratio']} | {r['published']:.2f}x | {r['predicted']:.2f}x | {r['error']:+.1%} | {target} | "
              f"{verdict} |")
    path = args.predictions.parent / f"comparison_round{out['round']}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\ncomparison: {path}")


if __name__ == "__main__":
    main()
