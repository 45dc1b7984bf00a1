"""EPLB on a skewed router, real: moe=ep's all-to-all over gloo on 4 ranks, the tiny model's MoE layers with a router
biased toward the experts rank 0 holds (skew.py). Per placement: the (token, expert) pairs each rank computes over
the measured steps, the slowest rank's count against the mean (what a step waits for) and its drop from v0.4's
contiguous blocks, the rebalances' cost (experts moved, bytes, summed over rebalances and the MoE layer), and the
median step time (CPU, noisy: not a claim).

    python experiments/eplb/run.py            # ~1 minute on the shared 2-core machine
    python experiments/eplb/run.py --quick    # fewer steps
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from framework.core.paths import git_sha  # noqa: E402
from framework.dist import launch  # noqa: E402
from plugins.moe.ep import EPConfig, EPLBConfig  # noqa: E402
from skew import MODEL, run_rank  # noqa: E402

SIZE, TOKENS, SKEW = 4, 64, 1.0


def placements(warmup: int) -> dict[str, EPConfig]:
    eplb = EPLBConfig(rebalance_every=warmup)
    return {"v0.4 contiguous blocks": EPConfig(),
            "EPLB, no redundant slots": EPConfig(eplb=eplb),
            "EPLB, +4 redundant (1/rank)": EPConfig(num_redundant_experts=4, eplb=eplb),
            "EPLB, +8 redundant (2/rank)": EPConfig(num_redundant_experts=8, eplb=eplb)}


def measure(warmup: int, steps: int, skew: float = SKEW, size: int = SIZE) -> list[dict]:
    rows = []
    for name, cfg in placements(warmup).items():
        ranks = launch(run_rank, size, cfg, skew, TOKENS, warmup, steps, backend="gloo", timeout_s=60)
        pairs = [r["pairs"] for r in ranks]
        mean = sum(pairs) / len(pairs)
        rows.append({"placement": name, "pairs_per_rank": pairs, "slowest_rank_pairs": max(pairs),
                     "imbalance": max(pairs) / mean, "rebalances": ranks[0]["rebalances"],
                     "experts_moved": ranks[0]["experts_moved"], "bytes_moved": ranks[0]["bytes_moved"],
                     "step_ms_median": max(r["step_ms_median"] for r in ranks),
                     "placement_layer1": ranks[0]["placement_layer1"]})
    for r in rows:
        r["slowest_vs_v04"] = r["slowest_rank_pairs"] / rows[0]["slowest_rank_pairs"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="2 ranks, a few steps: the test's run")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    warmup, steps = (2, 3) if args.tiny else (4, 8) if args.quick else (10, 40)
    size = 2 if args.tiny else SIZE
    t0 = time.time()
    rows = measure(warmup, steps, size=size)
    print(f"{size} ranks (gloo), {TOKENS} tokens per rank per step, {steps} measured steps after {warmup} recorded; "
          f"model {MODEL}; skew {SKEW}\n")
    print("| placement | pairs per rank | slowest rank | max/mean | slowest vs v0.4 | rebalances | experts moved | "
          "MB moved | step ms (median, slowest rank) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['placement']} | {r['pairs_per_rank']} | {r['slowest_rank_pairs']:,} | {r['imbalance']:.3f} | "
              f"{r['slowest_vs_v04']:.3f} | {r['rebalances']} | {r['experts_moved']} | {r['bytes_moved'] / 2**20:.2f} | "
              f"{r['step_ms_median']:.1f} |")
    out = {"experiment": "eplb", "quick": args.quick, "tiny": args.tiny, "git_sha": git_sha(), "size": size,
           "tokens_per_rank": TOKENS,
           "skew": SKEW, "warmup_steps": warmup, "measured_steps": steps, "model": MODEL,
           "wall_s": time.time() - t0, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nresults: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
