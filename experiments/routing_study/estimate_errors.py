"""Where the router's estimate of the cached prompt goes wrong, request by request (real cluster).

servelab's router sends each decision back with the answer (``X-Servelab-Route``: reason and estimate), and the load
client records it beside the worker's own count (``RequestRecord.route_reason``, ``estimated_cached``). This plays a
routing-study workload through each contender on the study's 4 workers and splits the estimate's error: the requests
it over-counted by more than ``--over`` tokens (a block or more that the worker did not serve from its cache), what
they were routed for, and where their TTFT ranks in their run (a request that waited long in a worker's queue may
have found its prefix evicted by the time it was scheduled: the view was right when the router decided); the rest is
the block granularity (a partly cached block counts for nothing: an under-count of < block_size per request).

    python experiments/routing_study/estimate_errors.py --workload multi_turn --contenders sticky_prefix \
        precise_prefix --repeats 3 [--out experiments/routing_study/estimate_errors]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import COMMON, CONTENDERS, WORKLOADS, run_cell  # noqa: E402

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.cluster.cluster import Cluster  # noqa: E402


def split_errors(records, over: int) -> dict:
    """One run's estimate error, as shares of its prompt tokens: the over-counted requests' part and the rest's."""
    ok = [r for r in records if r.ok and r.estimated_cached is not None]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    ttfts = sorted(r.ttft_s for r in ok)
    bad = [r for r in ok if r.estimated_cached - r.cached_tokens > over]
    return {"requests": len(ok), "estimate_error": sum(r.estimated_cached - r.cached_tokens for r in ok) / prompt,
            "over_counted": len(bad),
            "over_counted_error": sum(r.estimated_cached - r.cached_tokens for r in bad) / prompt,
            "rest_error": sum(r.estimated_cached - r.cached_tokens for r in ok if r not in bad) / prompt,
            "over_counted_reasons": sorted({r.route_reason for r in bad}),
            "over_counted_ttft_rank": [sum(t < r.ttft_s for t in ttfts) / len(ttfts) for r in bad],
            "over_counted_turns": [r.turn for r in bad],
            "median_ttft_ms": statistics.median(ttfts) * 1e3 if ttfts else float("nan"),
            "over_counted_median_ttft_ms": statistics.median(r.ttft_s for r in bad) * 1e3 if bad else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="multi_turn", choices=list(WORKLOADS))
    ap.add_argument("--contenders", nargs="+", default=["sticky_prefix", "precise_prefix"],
                    choices=[c for c in CONTENDERS if "/" not in c])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--over", type=int, default=64, help="tokens over the worker's count that make a request wrong")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    extra = COMMON + ["router.port=0"]
    cfg = compose(WORKLOADS[args.workload] + extra)
    runs = []
    cluster = Cluster(cfg)
    try:
        cluster.start_workers()
        cluster.warm_up()
        for rep in range(args.repeats):
            for c in args.contenders:
                figures, records = run_cell(cluster, cfg, compose(CONTENDERS[c] + extra).router)
                runs.append({"contender": c, "repeat": rep, "cache_hit_rate": figures["cache_hit_rate"]}
                            | split_errors(records, args.over))
                r = runs[-1]
                ranks = ", ".join(f"{x:.2f}" for x in sorted(r["over_counted_ttft_rank"]))
                print(f"{c:<16} {rep}  est. - hit {r['estimate_error']:+.4f} = over-counted {r['over_counted']:>2} "
                      f"requests {r['over_counted_error']:+.4f} + the rest {r['rest_error']:+.4f}; "
                      f"their TTFT {r['over_counted_median_ttft_ms']:.0f} ms (median {r['median_ttft_ms']:.0f}), "
                      f"rank in the run: {ranks}", flush=True)
    finally:
        cluster.stop()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.workload}.json").write_text(json.dumps(
            {"git_sha": git_sha(), "workload": args.workload, "over_tokens": args.over, "runs": runs,
             "overrides": WORKLOADS[args.workload] + extra}, indent=2) + "\n")


if __name__ == "__main__":
    main()
