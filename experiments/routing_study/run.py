"""Routing study: every servelab policy and SGLang's own router side by side, on the same workers and requests.

Real cluster (``--mode real``, the default): one set of 4 engine-instance worker processes (KV budget 6 MB each,
4,915 tokens: the caches compete) publishing their radix caches' KV events; each cell starts its own router process in
front of them (servelab's with the policy, or sglang-router 0.3.2 with ``router.impl=sglang``) after every cache is
flushed, and plays the workload through it with the streaming HTTP load client. Cells run in an interleaved order, one
repeat after another, so machine noise spreads over every contender.

Per cell: the workers' hit rate (meta_info.cached_tokens over prompt tokens) beside the workload's ceiling (one
unbounded cache that kept every prompt and answer, ``ceiling.py``), output throughput, TTFT p50 / p99, load imbalance
(max / mean requests per worker), and the router's estimate of the hit rate beside the measured one (exercise 2 of the
design document; SGLang's router reports none). One PNG per workload (plot.py).

Simulation (``--mode sim --instances 8 32 64``): the same rows (and a ``mode`` field) from ``mode=sim``, the
discrete-event simulator (framework/sim: the real schedulers and radix caches, the policy fed their KV events and
load reports), per cluster size: each workload's sessions (conversations, groups, agent sessions, trace requests and
the trace's replay speed) and its concurrency are scaled by instances / 4, so every size carries the real study's
load per instance. SGLang's router cannot run there: its rows are servelab's stand-ins (``STAND_INS``).

    python experiments/routing_study/run.py                  # ~30-40 minutes on the shared 2-core CPU
    python experiments/routing_study/run.py --quick          # a smoke run at tiny size (tests use it)
    python experiments/routing_study/run.py --workloads agent --contenders precise_prefix cache_aware/sglang
    python experiments/routing_study/run.py --mode sim --instances 8 32 64   # results_sim.json, table_sim.md
    python experiments/routing_study/run.py --mode sim --repeats 3 --contenders sticky_prefix cache_aware/sglang \
        --out experiments/routing_study/sim_seeds        # medians over seeds 0-2: the goal check with less luck
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceiling import hit_rate_ceiling  # noqa: E402
from plot import plot_workload  # noqa: E402

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import ROUTING, WORKLOAD  # noqa: E402
from framework.cluster.cluster import Cluster  # noqa: E402
from framework.cluster.figures import bench  # noqa: E402
from framework.cluster.peer_router import installed_version  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

# contender -> router overrides (conf/router/<option> and its settings); "/sglang": sglang-router 0.3.2
CONTENDERS = {
    "round_robin": ["router=round_robin"],
    "power_of_two": ["router=power_of_two"],
    "prefix_hash": ["router=prefix_hash"],
    "cache_aware": ["router=cache_aware"],
    "cache_aware_v2": ["router=cache_aware_v2"],
    # blocks of 8 tokens (the workers publish them: cluster.kv_block_size): the estimate misses at most 7 tokens of
    # a partly cached block per request; vLLM's 16 misses up to 15 (SGLang's own publisher uses its page size, 1)
    "precise_prefix": ["router=precise_prefix", "router.block_size=8"],
    "precise_prefix_bounded": ["router=precise_prefix", "router.block_size=8", "router.load_factor=1.25"],
    "kv_cost": ["router=kv_cost", "router.block_size=8"],
    # precise_prefix + session affinity + hot-prefix spill, on the 2025 thresholds (conf/router/sticky_prefix.yaml)
    "sticky_prefix": ["router=sticky_prefix", "router.block_size=8"],
    # SGLang's router: its cache_aware (2025 defaults, least-loaded miss: the v0.4 miss is not in 0.3.2) and
    # power_of_two on the loads its workers report
    "cache_aware/sglang": ["router=cache_aware_v2", "router.impl=sglang"],
    "power_of_two/sglang": ["router=power_of_two", "router.load=worker_tokens", "router.impl=sglang"],
}
SGLANG_CACHE_AWARE = "cache_aware/sglang"
# Scaled to 4 CPU workers with 4,915 tokens of KV each (see router_ablation for the first two).
WORKLOADS = {
    "multi_turn": ["workload=multi_turn", "workload.num_conversations=32", "workload.turns=6",
                   "workload.system_prompt_len=16", "workload.user_len=96", "workload.output_len=8",
                   "workload.max_concurrency=16"],
    "shared_prefix": ["workload=shared_prefix", "workload.num_groups=32", "workload.prompts_per_group=8",
                      "workload.system_prompt_len=512", "workload.question_len=32", "workload.output_len=8",
                      "workload.max_concurrency=16"],
    # the two Mooncake traces as conf/workload/trace.yaml scales them (16-character blocks, answers / 16, clock x20)
    "trace_conversation": ["workload=trace", "workload.num_requests=150"],
    "trace_synthetic": ["workload=trace", "workload.path=data/traces/synthetic_trace.jsonl.gz",
                        "workload.num_requests=150"],
    "agent": ["workload=agent", "workload.num_sessions=32", "workload.steps=4", "workload.tools_len=1024",
              "workload.max_concurrency=16"],
}
COMMON = ["cluster.instances=4", "engine.kv_budget_mb=6", "logger.mode=disabled", "seed=0", "cluster.kv_events=true",
          "cluster.kv_block_size=8",
          "workload.sample_interval_s=0"]    # no /metrics scrapes: they would count in the router's CPU
QUICK = ["cluster.instances=2", "engine.kv_budget_mb=3", "workload.num_requests=6", "workload.max_concurrency=2"]
QUICK_SIZE = {"agent": ["workload.tools_len=256"]}
# sim: SGLang's router rows become servelab's policies that make its decisions (checked on the real cluster)
STAND_INS = {"cache_aware/sglang": ["router=cache_aware_v2"],
             "power_of_two/sglang": ["router=power_of_two", "router.load=worker_tokens"]}
# sim: what grows with the cluster (times instances / 4), per workload
SCALED = {"multi_turn": ("num_conversations", "max_concurrency"), "shared_prefix": ("num_groups", "max_concurrency"),
          "trace_conversation": ("num_requests", "time_scale"), "trace_synthetic": ("num_requests", "time_scale"),
          "agent": ("num_sessions", "max_concurrency")}
KEYS = ("cache_hit_rate", "router_estimated_hit_rate", "router_confirmed_hit_rate", "output_throughput_tok_s",
        "ttft_p50_ms", "ttft_p99_ms", "load_imbalance", "requests_completed", "requests_failed", "duration_s",
        "router_cpu_us_per_req")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("real", "sim"), default="real")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--contenders", nargs="+", default=None, choices=list(CONTENDERS),
                    help="default: all (the sglang ones when sglang-router is installed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell, interleaved; the table shows medians "
                    "(--mode sim: repeat r runs seed=r: other requests, other ties)")
    ap.add_argument("--instances", nargs="+", type=int, default=[8, 32, 64], help="--mode sim: cluster sizes")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    if args.mode == "sim":
        return main_sim(args)
    contenders = args.contenders or [c for c in CONTENDERS if not c.endswith("/sglang") or installed_version()]
    torch.set_num_threads(1)
    extra = COMMON + ["router.port=0"] + (QUICK if args.quick else [])
    cfgs = {w: compose(WORKLOADS[w] + extra + (QUICK_SIZE.get(w, []) if args.quick else [])) for w in args.workloads}
    routers = {c: compose(CONTENDERS[c] + extra).router for c in contenders}
    ceilings = {w: hit_rate_ceiling(sessions_of(cfg)) for w, cfg in cfgs.items()}
    trials: dict[tuple[str, str], list[dict]] = {(w, c): [] for w in cfgs for c in contenders}
    t0 = time.time()
    cluster = Cluster(next(iter(cfgs.values())))    # the workers depend on model and engine only: one set for all
    try:
        cluster.start_workers()
        cluster.warm_up()
        for rep in range(args.repeats):
            for (w, c), runs in trials.items():
                runs.append(run_cell(cluster, cfgs[w], routers[c])[0] | {
                    "workload": w, "contender": c, "repeat": rep, "ceiling_hit_rate": ceilings[w]})
                r = runs[-1]
                print(f"  {w:<18} {c:<20} hit {r['cache_hit_rate']:.3f} (est {r['router_estimated_hit_rate']:.3f}) "
                      f"{r['output_throughput_tok_s']:7.1f} tok/s  TTFT p99 {r['ttft_p99_ms']:6.0f} ms  "
                      f"{r['duration_s']:5.1f} s", flush=True)
    finally:
        cluster.stop()
    rows = [median_row(runs) for runs in trials.values()]
    goals = goal_check(rows)
    print(table(rows))
    print("\n".join(goals["lines"]))
    args.out.mkdir(parents=True, exist_ok=True)
    plots = [str(plot_workload([r for r in rows if r["workload"] == w], w, ceilings[w], args.out / "plots"))
             for w in cfgs]
    out = {"experiment": "routing_study", "mode": args.mode, "git_sha": git_sha(), "wall_s": time.time() - t0,
           "repeats": args.repeats, "quick": args.quick, "sglang_router": installed_version(),
           "overrides": {"workloads": {w: WORKLOADS[w] for w in cfgs}, "contenders": {c: CONTENDERS[c] for c in
                                                                                      contenders}, "common": extra},
           "rows": rows, "goals": goals, "plots": plots, "trials": [t for rs in trials.values() for t in rs]}
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (args.out / "table.md").write_text(markdown(rows) + "\n".join(goals["lines"]) + "\n")
    print(f"results: {args.out / 'results.json'}  plots: {', '.join(Path(p).name for p in plots)}  "
          f"({out['wall_s']:.0f} s)")
    if any(r["requests_failed"] for r in rows):
        sys.exit("some requests failed: see requests_failed in the table")


def main_sim(args) -> None:
    """The same cells in mode=sim, per cluster size (workloads scaled by instances / 4)."""
    contenders = args.contenders or list(CONTENDERS)
    t0, rows, trials = time.time(), [], []
    for n in args.instances:
        for w in args.workloads:
            cfg = compose(sim_overrides(w, n, [], args.quick))
            ceiling = hit_rate_ceiling(sessions_of(cfg))
            for c in contenders:
                runs = []
                for rep in range(args.repeats):  # the simulator is deterministic: repeat r runs seed r
                    cell = compose(sim_overrides(w, n, STAND_INS.get(c, CONTENDERS[c]), args.quick) + [f"seed={rep}"])
                    results, _ = simulate(cell)
                    runs.append({k: results.get(k, float("nan")) for k in KEYS} | {
                        "workload": f"{w} x{n}", "contender": c, "repeat": rep, "ceiling_hit_rate": ceiling,
                        "mode": "sim", "instances": n, "stand_in": " ".join(STAND_INS.get(c, [])) or None,
                        "sim_wall_s": results["sim_wall_s"]})
                    r = runs[-1]
                    print(f"  {r['workload']:<22} {c:<20} hit {r['cache_hit_rate']:.3f} (est "
                          f"{r['router_estimated_hit_rate']:.3f}) {r['output_throughput_tok_s']:8.1f} tok/s  TTFT p99 "
                          f"{r['ttft_p99_ms']:6.0f} ms  ({r['sim_wall_s']:.1f} s)", flush=True)
                trials += runs
                rows.append(median_row(runs))
    goals = goal_check(rows)
    print(table(rows))
    print("\n".join(goals["lines"]))
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"experiment": "routing_study", "mode": "sim", "git_sha": git_sha(), "wall_s": time.time() - t0,
           "repeats": args.repeats, "quick": args.quick, "instances": args.instances, "stand_ins": STAND_INS,
           "scaled": SCALED, "overrides": {"workloads": {w: WORKLOADS[w] for w in args.workloads},
                                           "contenders": {c: CONTENDERS[c] for c in contenders},
                                           "common": COMMON + SIM_COMMON},
           "rows": rows, "goals": goals, "trials": trials}
    (args.out / "results_sim.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (args.out / "table_sim.md").write_text(markdown(rows) + "\n".join(goals["lines"]) + "\n")
    print(f"results: {args.out / 'results_sim.json'}  ({out['wall_s']:.0f} s)")
    if any(r["requests_failed"] for r in rows):
        sys.exit("some requests failed: see requests_failed in the table")


SIM_COMMON = ["mode=sim", "logger.plots=false"]


def sim_overrides(workload: str, instances: int, router: list[str], quick: bool) -> list[str]:
    """One sim cell's overrides: the real study's, on `instances` instances, the workload scaled by instances / 4."""
    base = compose(WORKLOADS[workload] + COMMON + (QUICK + QUICK_SIZE.get(workload, []) if quick else [])).workload
    scale = instances / 4
    grown = [f"workload.{k}={type(getattr(base, k))(getattr(base, k) * scale)}" for k in SCALED[workload]
             if getattr(base, k)]
    return (WORKLOADS[workload] + COMMON + SIM_COMMON + (QUICK + QUICK_SIZE.get(workload, []) if quick else [])
            + router + grown + [f"cluster.instances={instances}"])


def sessions_of(cfg):
    return WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()


def run_cell(cluster: Cluster, cfg, router_cfg) -> tuple[dict, list]:
    """One cell on cold caches behind a fresh router: its KEYS figures and the requests' records."""
    cluster.start_router(router_cfg)
    cluster.flush_caches()
    cpu0 = cluster.router_stats()["process_cpu_s"]
    results, records = bench(cluster, cfg, sessions_of(cfg))
    stats = cluster.router_stats()
    results["router_cpu_us_per_req"] = (stats["process_cpu_s"] - cpu0) / max(results["requests_completed"], 1) * 1e6
    return {k: results.get(k, float("nan")) for k in KEYS}, records


def median_row(trials: list[dict]) -> dict:
    row = dict(trials[0])
    for k in KEYS:
        values = [t[k] for t in trials]
        row[k] = sum(values) if k == "requests_failed" else statistics.median(values)
    row.pop("repeat")
    row["estimate_error"] = (row["router_estimated_hit_rate"] - row["cache_hit_rate"] if estimates(row)
                             else float("nan"))
    return row


@functools.cache
def keeps_estimate(overrides: tuple[str, ...]) -> bool:
    """Whether the policy these router overrides run declares an estimate of the cached prefix (`keeps_estimate`)."""
    return ROUTING.get(compose(list(overrides)).router.name).keeps_estimate


def estimates(row: dict) -> bool:
    """Whether the row's router estimated the hit rate: SGLang's reports none (nan); servelab's policies say whether
    they keep one, the others report 0 (in simulation SGLang's rows are the stand-in's policy)."""
    overrides = row["stand_in"].split() if row.get("stand_in") else CONTENDERS.get(row["contender"], [])
    est = row["router_estimated_hit_rate"]
    return est == est and bool(overrides) and keeps_estimate(tuple(overrides))


def goal_check(rows: list[dict]) -> dict:
    """The issue's goals, per workload: a servelab policy above SGLang's cache_aware on hit rate and below it on
    TTFT p99 at equal or better throughput; an exact view whose estimate is within 0.01 of the measured hit rate."""
    lines, per = [], {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w and "/" not in r["contender"]]
        ref = next((r for r in rows if r["workload"] == w and r["contender"] == SGLANG_CACHE_AWARE), None)
        winners = [] if ref is None else [r["contender"] for r in mine if
                                          r["cache_hit_rate"] > ref["cache_hit_rate"] and
                                          r["ttft_p99_ms"] < ref["ttft_p99_ms"] and
                                          r["output_throughput_tok_s"] >= ref["output_throughput_tok_s"]]
        exact = {r["contender"]: abs(r["estimate_error"]) for r in mine if r["contender"].startswith(
            ("precise_prefix", "kv_cost", "sticky_prefix"))}
        per[w] = {"beats_sglang_cache_aware": winners, "exact_view_abs_error": exact}
        lines.append(f"{w}: beats SGLang's cache_aware on hit, TTFT p99 and throughput: "
                     f"{', '.join(winners) or ('none' if ref else 'no SGLang row')}; exact view |estimate - measured|: "
                     + ", ".join(f"{c} {e:.4f}" for c, e in exact.items()))
    return {"per_workload": per, "lines": lines}


def markdown(rows: list[dict]) -> str:
    """The table for docs/routing.md and experiments/README.md (one per workload)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w]
        out += [f"**{w}** (ceiling {mine[0]['ceiling_hit_rate']:.3f})", "",
                "| router | hit rate | router est. | est. - hit | out tok/s | TTFT p50 ms | TTFT p99 ms | imbalance | "
                "router CPU us/req |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mine:
            est_cols = (f"{r['router_estimated_hit_rate']:.3f} | {r['estimate_error']:+.3f}"
                        if estimates(r) else " | ")
            out.append(f"| {r['contender']} | {r['cache_hit_rate']:.3f} | {est_cols} | "
                       f"{r['output_throughput_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                       f"{r['load_imbalance']:.2f} | {r['router_cpu_us_per_req']:.0f} |")
        out.append("")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    cols = [("workload", "workload", "{}"), ("router", "contender", "{}"), ("hit", "cache_hit_rate", "{:.3f}"),
            ("ceiling", "ceiling_hit_rate", "{:.3f}"), ("est.", "router_estimated_hit_rate", "{:.3f}"),
            ("est.-hit", "estimate_error", "{:+.3f}"), ("confirmed", "router_confirmed_hit_rate", "{:.3f}"),
            ("out tok/s", "output_throughput_tok_s", "{:.1f}"),
            ("TTFT p50", "ttft_p50_ms", "{:.0f}"), ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
            ("imbal.", "load_imbalance", "{:.2f}"), ("CPU us/req", "router_cpu_us_per_req", "{:.0f}"),
            ("failed", "requests_failed", "{}")]
    def shown(r, k):
        return r[k] == r[k] and (k != "router_estimated_hit_rate" or estimates(r))
    cells = [[c[0] for c in cols]] + [[fmt.format(r[k]) if shown(r, k) else "" for _, k, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [" | ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


if __name__ == "__main__":
    main()
