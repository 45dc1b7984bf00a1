"""Scale of mode=sim on this machine: 64 instances and 1,000,000 multi-turn requests (the issue: under 10 minutes,
about 1,700 simulated requests per wall second, memory bounded), and where the time goes.

One simulation of the study's config (conf/experiment/sim_scale.yaml: 64 single-rank instances of the tiny model
priced by the calibrated cost model, cache-aware routing, 250,000 conversations of 4 turns arriving at 150 per
second, no per-token times kept) prints wall and CPU seconds (the machine is shared: CPU seconds are what the
simulator itself used), simulated requests per second of each, the peak resident memory, and with --profile N a
cProfile of a run of N requests (the top functions by own time and cumulative time).

    python experiments/sim_scale/run.py                        # 1,000,000 requests (~10-20 min here)
    python experiments/sim_scale/run.py --requests 20000 --profile 20000   # a quick look and its profile

Writes results.json beside this file (or --out).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

KEYS = ("requests_completed", "duration_s", "output_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms",
        "cache_hit_rate", "load_imbalance", "max_running_requests", "retractions", "steps", "sim_wall_s",
        "sim_cpu_s", "sim_requests_per_wall_s")


def config(requests: int, extra: list[str]):
    turns = 4
    return compose(["mode=sim", "experiment=sim_scale", f"workload.num_conversations={-(-requests // turns)}",
                    f"workload.turns={turns}"] + extra)


def profile(requests: int, extra: list[str], top: int = 25) -> str:
    cfg = config(requests, extra)
    prof = cProfile.Profile()
    prof.enable()
    simulate(cfg)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--profile", type=int, default=0, help="also profile a run of this many requests (0: no)")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("overrides", nargs="*", help="extra overrides, e.g. cluster.instances=128")
    args = ap.parse_args()
    from framework.serving.http.server_base import tune_gc_for_serving
    tune_gc_for_serving()        # this process holds millions of live objects: no full re-scans of them (~15%)
    t0, cpu0 = time.perf_counter(), time.process_time()
    cfg = config(args.requests, args.overrides)
    from framework.core.registry import WORKLOAD
    WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()      # what the workload costs by itself
    gen_wall, gen_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results, _ = simulate(cfg, progress=sys.stderr.isatty())
    total_wall, total_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    row = {k: results[k] for k in KEYS}
    row.update({"instances": cfg.cluster.instances, "workload_wall_s": gen_wall, "workload_cpu_s": gen_cpu,
                "total_wall_s": total_wall, "total_cpu_s": total_cpu,
                "sim_requests_per_cpu_s": results["requests_completed"] / results["sim_cpu_s"],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "loadavg_1m": __import__("os").getloadavg()[0]})
    width = max(len(k) for k in row)
    print("\n".join(f"{k:<{width}}  {v:,.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                    for k, v in row.items()))
    out = {"experiment": "sim_scale", "git_sha": git_sha(), "requests": args.requests, "overrides": args.overrides,
           "note": "wall seconds on a shared 2-core machine; CPU seconds are the simulator's own", **row}
    if args.profile:
        out["profile"] = profile(args.profile, args.overrides)
        print(out["profile"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
