"""Two levels of load balancing (the design document's exercise 3), in mode=sim: router policy x the instance's
DP controller, on 8 instances of DeepSeek-V2 (fp8) over 8 x H100 each (conf/experiment/two_level.yaml).

The router sees 8 instances; inside each, SGLang's DP controller hands a request to one of its 8 DP-attention ranks
(`parallel.dp_balance=round_robin|shortest_queue`), and each rank keeps its own radix cache. The same 64 GPUs as 8
TP instances (one cache per instance, 1/6 of the KV) are the reference: there the router's choice is the cache's.
The DP controller's prefix-aware switches (`parallel.dp_balance=cache_aware|precise`: sgl-router's rule per DP
group, over an approximate view or the groups' KV events) are two more layouts, run when named in --layouts, and
`router.dp_aware=true` (the router's policy picks the (instance, DP group) itself) a third.
One run prints throughput, hit rate (against the workload's ceiling: one unbounded cache), TTFT p50/p99 and the
router's load imbalance per cell; writes results.json and two_level.png beside this file.

    python experiments/two_level/run.py                  # ~6 minutes on the shared 2-core machine
    python experiments/two_level/run.py --quick          # a few conversations: the smoke test
    python experiments/two_level/run.py --conversations 500 --routers round_robin cache_aware \
        --layouts "tp x8 (one cache)" "dp_attn x8, DP round_robin" "dp_attn x8, DP cache_aware" \
        "dp_attn x8, DP precise" --out experiments/two_level/dp_balance   # a lighter load, ~14 minutes
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

sys.path.insert(0, str(HERE.parent / "routing_study"))
from ceiling import hit_rate_ceiling  # noqa: E402

ROUTERS = ("round_robin", "cache_aware", "precise_prefix")
LAYOUTS = {"tp x8 (one cache)": ["parallel=tp", "engine.chunked_prefill_tokens=8192"],
           "dp_attn x8, DP round_robin": ["parallel.dp_balance=round_robin"],
           "dp_attn x8, DP shortest_queue": ["parallel.dp_balance=shortest_queue"]}
# servelab's prefix-aware DP controllers (framework/contracts/dp_controller.py): chosen with --layouts
DP_BALANCE_LAYOUTS = {"dp_attn x8, DP cache_aware": ["parallel.dp_balance=cache_aware"],
                      "dp_attn x8, DP precise": ["parallel.dp_balance=precise"],
                      # the router picks the DP group itself (sgl-router's --dp-aware); the DP controller obeys
                      "dp_attn x8, router dp_aware": ["parallel.dp_balance=round_robin", "router.dp_aware=true"]}
ALL_LAYOUTS = {**LAYOUTS, **DP_BALANCE_LAYOUTS}
QUICK = ["workload.num_conversations=40", "workload.request_rate=20"]
KEYS = ("output_throughput_tok_s", "cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance",
        "kv_capacity_tokens_instance", "requests_completed", "sim_wall_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--layouts", nargs="*", choices=list(ALL_LAYOUTS), default=list(LAYOUTS),
                    help="instance layouts to run (default: SGLang v0.4's three)")
    ap.add_argument("--routers", nargs="*", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--conversations", type=int, default=0,
                    help="fewer conversations over the same 20 s of arrivals (a lighter load); 0: the config's")
    args = ap.parse_args()
    extra = QUICK if args.quick else []
    if args.conversations:
        extra = [f"workload.num_conversations={args.conversations}", f"workload.request_rate={args.conversations / 20}"]
    base = compose(["experiment=two_level"] + extra)
    ceiling = hit_rate_ceiling(WORKLOAD.build(base.workload.name, base.workload, base.seed).sessions())
    t0, rows = time.time(), []
    for layout, overrides in ((k, ALL_LAYOUTS[k]) for k in args.layouts):
        for router in args.routers:
            results, _ = simulate(compose(["experiment=two_level", f"router={router}"] + overrides + extra))
            rows.append({"layout": layout, "router": router, **{k: results[k] for k in KEYS}})
            r = rows[-1]
            print(f"{layout:30s} {router:15s} {r['output_throughput_tok_s']:8,.0f} tok/s  hit {r['cache_hit_rate']:.3f}"
                  f"  TTFT p50 {r['ttft_p50_ms']:6,.0f} p99 {r['ttft_p99_ms']:6,.0f} ms  ({r['sim_wall_s']:.0f} s)",
                  flush=True)
    print(f"\nhit-rate ceiling (one unbounded cache): {ceiling:.3f}\n")
    print("| instance layout | router | output tok/s | hit rate | TTFT p50 ms | TTFT p99 ms | load imbalance | "
          "KV tokens / instance |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['router']} | {r['output_throughput_tok_s']:,.0f} | {r['cache_hit_rate']:.3f} | "
              f"{r['ttft_p50_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} | {r['load_imbalance']:.3f} | "
              f"{r['kv_capacity_tokens_instance']:,} |")
    out = {"experiment": "two_level", "config": "conf/experiment/two_level.yaml", "quick": args.quick,
           "overrides": extra,
           "git_sha": git_sha(), "wall_s": time.time() - t0, "hit_rate_ceiling": ceiling, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    if args.layouts == list(LAYOUTS) and len(args.routers) == len(ROUTERS):   # the plot's grid: every cell
        plot(rows, ceiling, args.out / "two_level.png")
    print(f"results: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")


def plot(rows: list[dict], ceiling: float, path: Path) -> None:
    """Hit rate, TTFT p99 and output throughput per layout (named once, on the left) and router (one colour
    each): horizontal bars, three panels a row, the legend below them (it covers no bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 3, sharey=True, layout="constrained", figsize=(14, 1.6 + 0.32 * len(LAYOUTS) *
                                                                                    len(ROUTERS)))
    height = 0.8 / len(ROUTERS)
    for ax, (key, label) in zip(axes, (("cache_hit_rate", "hit rate"), ("ttft_p99_ms", "TTFT p99 (ms)"),
                                       ("output_throughput_tok_s", "output tok/s"))):
        for i, router in enumerate(ROUTERS):
            values = [next(r[key] for r in rows if r["layout"] == lay and r["router"] == router) for lay in LAYOUTS]
            ax.barh([y - 0.4 + height * (i + 0.5) for y in range(len(LAYOUTS))], values, height, label=router)
        if key == "cache_hit_rate":
            ax.axvline(ceiling, color="k", ls="--", lw=1, label="ceiling")
        ax.set_title(label)
        ax.grid(axis="x", alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))         # 20,000-wide labels: room for each
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.6g}"))
    axes[0].set_yticks(range(len(LAYOUTS)), list(LAYOUTS), fontsize=8)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=len(ROUTERS) + 1, fontsize=8)
    fig.suptitle("router x DP controller: 8 instances of DeepSeek-V2 fp8 on 8 x H100 (mode=sim, roofline)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
