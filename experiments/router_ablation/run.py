"""Router ablation: round_robin vs random vs cache_aware (v0.4 defaults) vs cache_aware_v2 (2025 defaults), on the
shared_prefix and multi_turn workloads, through one real cluster of 4 engine instances over HTTP; each policy run by
servelab's router and, beside it in the same run, by SGLang's own router (sglang-router 0.3.2, `--impls`), wherever
SGLang's router can express the policy (not v0.4's smallest-tree miss: see framework/cluster/peer_router.py).

One set of 4 workers serves every run (each run starts its own router process with that policy, after every worker's
prefix cache is flushed: loop.py, the loop pd_side_by_side shares), so all runs see the same engines, KV budgets and
request sequences (same seed). The per-worker
KV budget is small on purpose: the caches compete, so where a request lands decides whether its prefix is cached.
Router CPU per request is the router process's CPU time over the run (servelab: its /router_stats; SGLang: /proc)
divided by the requests.

    python experiments/router_ablation/run.py            # ~3-4 minutes on the shared 2-core CPU
    python experiments/router_ablation/run.py --quick    # a smoke run at tiny size (tests use it)
    python experiments/router_ablation/run.py --overrides workload.seed=1   # the same workloads, another draw

Prints one table and writes results.json beside this file (or to --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.cluster.peer_router import PeerRouterError, installed_version, sglang_router_args  # noqa: E402
from loop import Cell, median_run, run_cells, table as render, with_workers  # noqa: E402

POLICIES = ("round_robin", "random", "cache_aware", "cache_aware_v2")   # conf/router/<option>
IMPLS = ("servelab", "sglang")                                         # router.impl
# Scaled from SGLang's setup (several long shared-prefix groups, 8 workers): a 6 MB KV budget is 4,915 tokens per
# worker, room for a quarter of the 32 group prefixes (8 x 514 tokens) but far from all of them (16,448).
WORKLOADS = {
    "shared_prefix": ["workload=shared_prefix", "workload.num_groups=32", "workload.prompts_per_group=8",
                      "workload.system_prompt_len=512", "workload.question_len=32", "workload.output_len=8",
                      "workload.max_concurrency=16"],
    # a short shared system prompt: a new conversation's first turn matches < cache_threshold, so it is spread
    "multi_turn": ["workload=multi_turn", "workload.num_conversations=32", "workload.turns=6",
                   "workload.system_prompt_len=16", "workload.user_len=96", "workload.output_len=8",
                   "workload.max_concurrency=16"],
    # not run by default: a long system prompt shared by every conversation (the default multi_turn shape); each
    # first turn matches it above cache_threshold, so cache-aware sends every conversation to the first worker
    # until the load gap exceeds balance_abs_threshold, which 16 concurrent conversations never reach
    "multi_turn_long_system": ["workload=multi_turn", "workload.num_conversations=32", "workload.turns=6",
                               "workload.system_prompt_len=256", "workload.user_len=48", "workload.output_len=8",
                               "workload.max_concurrency=16"],
}
DEFAULT_WORKLOADS = ("shared_prefix", "multi_turn")
COMMON = ["cluster.instances=4", "engine.kv_budget_mb=6", "logger.mode=disabled", "seed=0",
          "workload.sample_interval_s=0"]    # no /metrics scrapes: they would count in the router's CPU
QUICK = ["cluster.instances=2", "workload.max_concurrency=1", "workload.system_prompt_len=64", "engine.kv_budget_mb=1"]
# else: 8 requests; multi_turn's at 3 turns, so that any draw's last prompt fits the quick KV budget (819 tokens: a
# request may hold 817, prompt and new tokens)
QUICK_SIZE = {"shared_prefix": ["workload.num_groups=2", "workload.prompts_per_group=4"],
              "multi_turn": ["workload.num_requests=8", "workload.turns=3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--port", type=int, default=0, help="router port, workers on the following ones (0: free ports)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--impls", nargs="+", default=[i for i in IMPLS if i == "servelab" or installed_version()],
                    choices=IMPLS, help="router implementations (default: sglang too when sglang-router is installed)")
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell; the table shows medians")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--overrides", nargs="+", default=[],
                    help="Hydra overrides after every other, for every run (workload.seed=1: another draw of the "
                         "same workloads, as experiments/sim_fidelity's level blocks run them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    extra = COMMON + [f"router.port={args.port}"] + (QUICK if args.quick else [])
    size = {w: (QUICK_SIZE.get(w, ["workload.num_requests=8"]) if args.quick else []) + args.overrides
            for w in args.workloads}         # (the overrides last: they win over the quick sizes)
    cfgs = {w: compose(WORKLOADS[w] + extra + size[w]) for w in args.workloads}
    routers = {}
    for p in args.policies:
        for impl in args.impls:
            rc = compose([f"router={p}", f"router.impl={impl}"] + extra + args.overrides).router
            try:
                if impl == "sglang":
                    sglang_router_args(rc, rc, ["http://w"], 1, 2)
                routers[p, impl] = rc
            except PeerRouterError as e:
                print(f"  skipped {p} on {impl}: {e}")
    cells = {(w, p, impl): Cell(rc, cfgs[w], {"workload": w, "router": p, "impl": impl})
             for w in cfgs for (p, impl), rc in routers.items()}
    t0 = time.time()
    # the workers depend on model and engine only: one set for all
    trials = with_workers(next(iter(cfgs.values())), lambda cluster: run_cells(cluster, cells, args.repeats))
    runs = [median_run(rs) for rs in trials.values()]
    add_ratios(runs)
    print(table(runs))
    out = {"experiment": "router_ablation", "git_sha": git_sha(), "wall_s": time.time() - t0,
           "repeats": args.repeats, "sglang_router": installed_version(),
           "overrides": {w: WORKLOADS[w] + extra + size[w] for w in args.workloads},
           "runs": runs, "trials": [t for rs in trials.values() for t in rs]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"results: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")
    if any(r["requests_failed"] for r in runs):
        sys.exit("some requests failed: see requests_failed in the table")


def add_ratios(runs: list[dict]) -> None:
    """Against round-robin on the same workload and router implementation."""
    for r in runs:
        base = next((b for b in runs if b["workload"] == r["workload"] and b["router"] == "round_robin"
                     and b["impl"] == r["impl"]), None)
        for key, name in (("cache_hit_rate", "hit_rate_vs_rr"), ("output_throughput_tok_s", "throughput_vs_rr"),
                          ("ttft_p50_ms", "ttft_p50_vs_rr")):
            r[name] = r[key] / base[key] if base and base[key] else float("nan")


def table(runs: list[dict]) -> str:
    cols = [("workload", "workload", "{}"), ("router", "router", "{}"), ("impl", "impl", "{}"),
            ("hit rate", "cache_hit_rate", "{:.3f}"), ("router est.", "router_estimated_hit_rate", "{:.3f}"),
            ("out tok/s", "output_throughput_tok_s", "{:.1f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
            ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"), ("imbalance", "load_imbalance", "{:.2f}"),
            ("router CPU us/req", "router_cpu_us_per_req", "{:.0f}"), ("hit x RR", "hit_rate_vs_rr", "{:.2f}"),
            ("tput x RR", "throughput_vs_rr", "{:.2f}"), ("failed", "requests_failed", "{}")]
    return render(cols, runs, text_cols=3)


if __name__ == "__main__":
    main()
