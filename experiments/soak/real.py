"""The soak's real half, short: the operator's replay scenario (issue 25) on a real cluster, and the decision time the
HTTP router measures (``/router_stats`` ``router_decision_us``) per policy.

4 engine-instance worker processes on loopback (the routing study's: 6 MB of KV each, 8-token KV blocks published);
for each router, its own router process in front of them, then a small agent trace (12 sessions of 6 steps behind 4
shared tool prefixes, 8 clients) played ``--replays`` times with every
worker's ``POST /flush_cache`` before each (straight to the workers, as an operator would: the router hears it only
through the KV events of a policy that follows them). Per replay: the hit rate the workers reported, TTFT p99, the
router's decision p50 / p99, and its policy's state entries (``policy_state``). Writes results_real.json.

    python experiments/soak/real.py [--routers cache_aware precise_prefix sticky_prefix] [--replays 3] [--quick]
                                    [--sessions 12]

``--sessions``: more sessions of the same kind (more decisions behind each p50: 6 per session).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.cluster.cluster import Cluster  # noqa: E402
from framework.cluster.figures import bench  # noqa: E402
from framework.config import compose  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402

COMMON = ["cluster.instances=4", "engine.kv_budget_mb=6", "logger.mode=disabled", "seed=0", "cluster.kv_events=true",
          "cluster.kv_block_size=8", "workload.sample_interval_s=0", "router.port=0"]
# the agent trace of tests/sim/test_policy_state_replay.py (12 sessions of 6 steps): small enough for minutes per router
TRACE = ["workload=agent", "workload.num_sessions=12", "workload.steps=6", "workload.tools_len=512",
         "workload.max_concurrency=8"]
QUICK = ["cluster.instances=2", "engine.kv_budget_mb=3", "workload.num_sessions=4", "workload.steps=3",
         "workload.max_concurrency=4", "workload.tools_len=256"]


def router_overrides(router: str) -> list[str]:
    overrides = [f"router={router}"]
    if "block_size" in compose(overrides).router.__dataclass_fields__:
        overrides.append("router.block_size=8")
    return overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routers", nargs="+", default=["cache_aware", "precise_prefix", "sticky_prefix", "kv_cost"])
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sessions", type=int, default=None, help="sessions per replay (default: the trace's 12)")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    torch.set_num_threads(1)
    extra = COMMON + TRACE + (QUICK if args.quick else [])
    if args.sessions is not None:
        extra.append(f"workload.num_sessions={args.sessions}")
    cfg = compose(extra)
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    rows, t0 = [], time.time()
    cluster = Cluster(cfg)
    try:
        cluster.start_workers()
        cluster.warm_up()
        for router in args.routers:
            cluster.start_router(compose(extra + router_overrides(router)).router)
            for k in range(args.replays):
                cluster.flush_caches()
                time.sleep(0.3)  # the AllBlocksCleared events reach the router before the first request
                results, _ = bench(cluster, cfg, sessions)
                stats = cluster.router_stats()
                us = stats["router_decision_us"]
                row = {"router": router, "replay": k + 1, "hit_rate": results["cache_hit_rate"],
                       "estimated_hit_rate": stats["estimated_hit_rate"], "ttft_p99_ms": results["ttft_p99_ms"],
                       "output_tok_s": results["output_throughput_tok_s"], "decision_p50_us": us["p50"],
                       "decision_p99_us": us["p99"], "decisions": stats["decisions"],
                       "state_entries": sum(stats.get("policy_state", {}).values()),
                       "reasons": stats["reasons"], "failed": results["requests_failed"]}
                rows.append(row)
                print(f"  {router:15s} replay {k + 1}: hit {row['hit_rate']:.3f} (est {row['estimated_hit_rate']:.3f})"
                      f"  TTFT p99 {row['ttft_p99_ms']:6.0f} ms  decision p50 {row['decision_p50_us']:6.1f} us "
                      f"p99 {row['decision_p99_us']:7.1f} us  entries {row['state_entries']}", flush=True)
    finally:
        cluster.stop()
    print("| router | replay | hit rate | TTFT p99 ms | decision p50 us | p99 us | state entries |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['router']} | {r['replay']} | {r['hit_rate']:.3f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['decision_p50_us']:.1f} | {r['decision_p99_us']:.1f} | {r['state_entries']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"mode": "real", "overrides": extra, "replays": args.replays, "rows": rows, "wall_s": time.time() - t0}
    (args.out / "results_real.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"results: {args.out / 'results_real.json'}  ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
