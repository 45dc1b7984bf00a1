"""P/D side by side: sglang-router 0.3.2's P/D mode (`--pd-disaggregation`) and servelab's router with the same
routing policy, in front of the same prefill worker and decode worker (cluster.roles=[prefill,decode]), on a small
shared_prefix workload; servelab's router also with llm-d's decode-first decider (short uncached prompts prefilled on
the decode worker, engine.disaggregation_local_prefill=true) and Dynamo's conditional one.

One pair of workers serves every run (each run starts its own router process, after both workers' prefix caches are
flushed: experiments/router_ablation/loop.py, the loop router_ablation shares), so every row sees the same engines and
request sequence (same seed). Goodput is the requests per second
that met the stated SLO (TTFT and TPOT, --ttft-ms, --tpot-ms). Router CPU per request is the router process's CPU
time over the run (servelab: its /router_stats; SGLang: /proc) divided by the requests. The machine is noisy (2
shared cores): the table shows medians over --repeats runs, interleaved.

    python experiments/pd_side_by_side/run.py              # ~3 minutes on the shared 2-core CPU
    python experiments/pd_side_by_side/run.py --quick      # a smoke run at tiny size

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
sys.path.insert(0, str(ROOT / "experiments" / "router_ablation"))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.cluster.peer_router import installed_version  # noqa: E402
from loop import Cell, median_run, run_cells, table as render, with_workers  # noqa: E402

# (row name, router.impl, router.pd_decider): sglang-router has no decider, it pairs every request
ROUTERS = (("sglang", "sglang", "always"), ("servelab", "servelab", "always"),
           ("servelab decode_first", "servelab", "decode_first"), ("servelab conditional", "servelab", "conditional"))
WORKLOAD_ARGS = ["workload=shared_prefix", "workload.num_groups=4", "workload.prompts_per_group=8",
                 "workload.system_prompt_len=192", "workload.question_len=16", "workload.output_len=16",
                 "workload.max_concurrency=4"]
COMMON = ["cluster.instances=2", "cluster.roles=[prefill,decode]", "engine.kv_budget_mb=2", "engine.device=cpu",
          "engine.disaggregation_local_prefill=true", "cluster.restart_workers=false", "logger.mode=disabled",
          "router.control_plane_audit_enabled=false", "seed=0",
          "workload.sample_interval_s=0"]   # no /metrics scrapes: they would count in the router's CPU
QUICK = ["workload.num_groups=2", "workload.prompts_per_group=3", "workload.max_concurrency=2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--policy", default="cache_aware_v2", help="conf/router/<option>, the same for every row")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row; the table shows medians")
    ap.add_argument("--ttft-ms", type=float, default=1500.0, help="the SLO's TTFT bound (goodput)")
    ap.add_argument("--tpot-ms", type=float, default=150.0, help="the SLO's TPOT bound (goodput)")
    ap.add_argument("--local-max-tokens", type=int, default=64,
                    help="router.pd_local_prefill_max_tokens for the deciders (uncached tokens prefilled locally)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    torch.set_num_threads(1)
    extra = COMMON + [f"workload.slo.ttft_ms={args.ttft_ms}", f"workload.slo.tpot_ms={args.tpot_ms}"]
    cfg = compose(WORKLOAD_ARGS + extra + (QUICK if args.quick else []) + [f"router={args.policy}"])
    rows = [r for r in ROUTERS if r[1] == "servelab" or installed_version()]
    if len(rows) < len(ROUTERS):
        print("  sglang-router is not installed ('.[peers]'): servelab's rows only")
    routers = {name: compose(extra + [f"router={args.policy}", f"router.impl={impl}"] + (
        [f"router.pd_decider={decider}", f"router.pd_local_prefill_max_tokens={args.local_max_tokens}"]
        if impl == "servelab" else [])).router for name, impl, decider in rows}
    cells = {name: Cell(rc, cfg, {"router": name}) for name, rc in routers.items()}

    def paired(results: dict, records: list) -> dict:
        n = sum(1 for r in records if r.ok and r.kv_transfer_bytes > 0)
        return {"paired_fraction": n / max(results["requests_completed"], 1)}

    t0 = time.time()
    trials = with_workers(cfg, lambda cluster: run_cells(cluster, cells, args.repeats, extra=paired))
    runs = [median_run(ts) for ts in trials.values()]
    print(table(runs))
    out = {"experiment": "pd_side_by_side", "git_sha": git_sha(), "wall_s": time.time() - t0,
           "repeats": args.repeats, "sglang_router": installed_version(), "policy": args.policy,
           "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
           "overrides": WORKLOAD_ARGS + extra + (QUICK if args.quick else []), "runs": runs,
           "trials": [t for ts in trials.values() for t in ts]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"results: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")
    if any(r["requests_failed"] for r in runs):
        sys.exit("some requests failed: see requests_failed in the table")


def table(runs: list[dict]) -> str:
    cols = [("router", "router", "{}"), ("goodput req/s", "goodput_req_s", "{:.2f}"),
            ("SLO met", "slo_attainment", "{:.2f}"), ("out tok/s", "output_throughput_tok_s", "{:.1f}"),
            ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
            ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"), ("TPOT p99 ms", "tpot_p99_ms", "{:.1f}"),
            ("hit rate", "cache_hit_rate", "{:.3f}"), ("paired", "paired_fraction", "{:.2f}"),
            ("router CPU us/req", "router_cpu_us_per_req", "{:.0f}"), ("failed", "requests_failed", "{}")]
    return render(cols, runs)


if __name__ == "__main__":
    main()
