"""The design document's routing figures at its own scale, in mode=sim (issue 9, items 5b and 5c).

``router_blog`` (conf/experiment/sglang_router_blog.yaml): SGLang v0.4's cache-aware router against round robin,
8 single-GPU A100 workers, bench_serving's generated-shared-prefix dataset at its defaults, all sent at once (SGLang
PR #2170: 82,665 -> 158,596 tok/s, hit rate 20% -> 75%). Throughput is counted as bench_serving's figure must be:
input + output tokens over the run (output alone would need 8 A100s to prefill 1.8 M tokens in 3.2 s, above their
peak FLOPs). Beside each hit rate, two brute-force ceilings: one unbounded cache for everything, and round robin's
(one unbounded cache per worker, each seeing the requests round robin gives it). Each configuration runs with the
Llama-3.1-8B stand-in (the benchmark's model) and with DeepSeek-V2-Lite (the nearest real model in conf/model/).

``mooncake`` (conf/experiment/mooncake_trace.yaml): the Mooncake conversation trace, all 12,031 requests at its own
clock, on 8 and 32 instances of DeepSeek-V2 (8 x H100, TP 8 each), every routing policy; hit rate against the trace's
ceiling (one unbounded cache), throughput and TTFT; the simulator's wall time per run.

    python experiments/sim_repro/run.py                          # both parts (~15 minutes on the shared 2 cores)
    python experiments/sim_repro/run.py --parts router_blog      # seconds
    python experiments/sim_repro/run.py --quick --out /tmp/x     # tiny variants of both (tests use it)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments" / "routing_study"))

from ceiling import hit_rate_ceiling  # noqa: E402
from plot import plot_workload  # noqa: E402

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

# SGLang PR #2170's table (8 x A100, dp-size 8, generated-shared-prefix defaults)
DOC_BLOG = {"round_robin": {"total_throughput_tok_s": 82665.0, "cache_hit_rate": 0.20},
            "cache_aware": {"total_throughput_tok_s": 158596.72, "cache_hit_rate": 0.75}}
DOC_TRACE_CEILING = 0.366          # the conversation trace, whole 512-token blocks, one unbounded cache
BLOG_MODELS = ("llama31_8b_mla", "deepseek_v2_lite")
POLICIES = ("round_robin", "random", "power_of_two", "prefix_hash", "cache_aware", "cache_aware_v2", "precise_prefix",
            "kv_cost")
INSTANCES = (8, 32)
QUICK = {"router_blog": ["cluster.instances=2", "workload.num_groups=4", "workload.prompts_per_group=4",
                         "workload.system_prompt_len=256", "workload.question_len=16", "workload.output_len=8"],
         "mooncake": ["workload.num_requests=40", "workload.time_scale=20", "workload.block_tokens=32",
                      "workload.max_output_len=16"]}
KEYS = ("cache_hit_rate", "router_estimated_hit_rate", "total_throughput_tok_s", "output_throughput_tok_s",
        "input_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance", "requests_completed",
        "requests_failed", "duration_s", "kv_capacity_tokens_instance", "sim_wall_s", "sim_cpu_s")


def run_cell(overrides: list[str]) -> dict:
    results, _ = simulate(compose(overrides))
    return {k: results.get(k, float("nan")) for k in KEYS}


def sessions_of(cfg):
    return WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()


def router_blog(quick: bool) -> dict:
    rows = []
    for model in BLOG_MODELS[:1] if quick else BLOG_MODELS:
        base = ["experiment=sglang_router_blog", f"model={model}"] + (QUICK["router_blog"] if quick else [])
        cfg = compose(base)
        sessions = sessions_of(cfg)
        n = cfg.cluster.instances
        ceilings = {"one cache": hit_rate_ceiling(sessions), "round robin": hit_rate_ceiling(sessions, lambda i: i % n)}
        for router in DOC_BLOG:
            row = run_cell(base + [f"router={router}"]) | {"model": model, "router": router,
                                                          "ceiling_hit_rate": ceilings["one cache"],
                                                          "rr_ceiling_hit_rate": ceilings["round robin"]}
            rows.append(row)
            print(f"  router_blog {model:<18} {router:<12} hit {row['cache_hit_rate']:.3f}  total "
                  f"{row['total_throughput_tok_s']:9,.0f} tok/s  ({row['sim_wall_s']:.1f} s)", flush=True)
    ratios = []
    for model in dict.fromkeys(r["model"] for r in rows):
        rr, ca = (next(r for r in rows if r["model"] == model and r["router"] == x) for x in DOC_BLOG)
        ratio = {k: ca[k] / rr[k] for k in ("cache_hit_rate", "total_throughput_tok_s")}
        doc = {k: DOC_BLOG["cache_aware"][k] / DOC_BLOG["round_robin"][k] for k in ratio}
        ratios.append({"model": model, **{f"{k}_ratio": v for k, v in ratio.items()},
                       **{f"{k}_ratio_doc": v for k, v in doc.items()},
                       **{f"{k}_ratio_error": ratio[k] / doc[k] - 1 for k in ratio}})
    return {"rows": rows, "ratios": ratios}


def mooncake(quick: bool, instances=INSTANCES, policies=POLICIES) -> dict:
    rows, ceiling = [], None
    for n in (2,) if quick else instances:
        base = ["experiment=mooncake_trace", f"cluster.instances={n}"] + (QUICK["mooncake"] if quick else [])
        if ceiling is None:
            ceiling = hit_rate_ceiling(sessions_of(compose(base)))
        for policy in policies:
            row = run_cell(base + [f"router={policy}"]) | {"instances": n, "router": policy, "ceiling_hit_rate": ceiling}
            rows.append(row)
            print(f"  mooncake x{n:<3} {policy:<15} hit {row['cache_hit_rate']:.3f} (ceiling {ceiling:.3f}, est "
                  f"{row['router_estimated_hit_rate']:.3f})  total {row['total_throughput_tok_s']:7,.0f} out "
                  f"{row['output_throughput_tok_s']:7,.0f} tok/s  TTFT p50/p99 {row['ttft_p50_ms']:6,.0f} / "
                  f"{row['ttft_p99_ms']:7,.0f} ms  imbalance {row['load_imbalance']:.2f}  failed "
                  f"{row['requests_failed']}  ({row['sim_wall_s']:.0f} s wall, {row['sim_cpu_s']:.0f} s CPU)", flush=True)
    return {"rows": rows, "ceiling_hit_rate": ceiling, "ceiling_hit_rate_doc": DOC_TRACE_CEILING}


def blog_markdown(part: dict) -> str:
    out = ["| model | router | hit rate | (doc) | RR ceiling | ceiling | total tok/s | (doc) | output tok/s | "
           "TTFT p50 / p99 ms | sim wall s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part["rows"]:
        doc = DOC_BLOG[r["router"]]
        out.append(f"| {r['model']} | {r['router']} | {r['cache_hit_rate']:.3f} | {doc['cache_hit_rate']:.2f} | "
                   f"{r['rr_ceiling_hit_rate']:.3f} | {r['ceiling_hit_rate']:.3f} | {r['total_throughput_tok_s']:,.0f} | "
                   f"{doc['total_throughput_tok_s']:,.0f} | {r['output_throughput_tok_s']:,.0f} | "
                   f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} | {r['sim_wall_s']:.1f} |")
    out += ["", "| model | hit rate ratio | (doc) | error | throughput ratio | (doc) | error |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for q in part["ratios"]:
        out.append(f"| {q['model']} | {q['cache_hit_rate_ratio']:.2f}x | {q['cache_hit_rate_ratio_doc']:.2f}x | "
                   f"{q['cache_hit_rate_ratio_error']:+.0%} | {q['total_throughput_tok_s_ratio']:.2f}x | "
                   f"{q['total_throughput_tok_s_ratio_doc']:.2f}x | {q['total_throughput_tok_s_ratio_error']:+.0%} |")
    return "\n".join(out) + "\n"


def mooncake_markdown(part: dict) -> str:
    out = [f"Ceiling (one unbounded cache): {part['ceiling_hit_rate']:.3f} here, {DOC_TRACE_CEILING} in the document "
           "(whole blocks only).", "",
           "| instances | router | hit rate | router est. | total tok/s | output tok/s | TTFT p50 ms | TTFT p99 ms | "
           "imbalance | sim wall / CPU s |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part["rows"]:
        est = r["router_estimated_hit_rate"]
        out.append(f"| {r['instances']} | {r['router']} | {r['cache_hit_rate']:.3f} | "
                   f"{f'{est:.3f}' if est == est and est > 0 else ''} | {r['total_throughput_tok_s']:,.0f} | "
                   f"{r['output_throughput_tok_s']:,.0f} | {r['ttft_p50_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} | "
                   f"{r['load_imbalance']:.2f} | {r['sim_wall_s']:.0f} / {r['sim_cpu_s']:.0f} |")
    return "\n".join(out) + "\n"


def plot_blog(part: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = ["document"] + list(dict.fromkeys(r["model"] for r in part["rows"]))
    x, w = np.arange(len(DOC_BLOG)), 0.8 / len(labels)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "cache_hit_rate", "Cache hit rate"),
                           (axes[1], "total_throughput_tok_s", "Throughput (input + output tok/s)")):
        for j, label in enumerate(labels):
            values = [DOC_BLOG[r][key] if label == "document" else
                      next(row[key] for row in part["rows"] if row["model"] == label and row["router"] == r)
                      for r in DOC_BLOG]
            ax.bar(x + (j - (len(labels) - 1) / 2) * w, values, w, label=label,
                   color="black" if label == "document" else None, alpha=0.8)
        ax.set_xticks(x, list(DOC_BLOG))
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    rr = part["rows"][0]["rr_ceiling_hit_rate"]
    axes[0].axhline(rr, color="tab:red", ls=":", lw=1, label=f"round robin's ceiling {rr:.2f}")
    axes[0].axhline(part["rows"][0]["ceiling_hit_rate"], color="black", ls="--", lw=1, label="ceiling")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("SGLang's router benchmark (PR #2170) in mode=sim: 8 x A100, generated-shared-prefix", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("router_blog", "mooncake"), default=["router_blog", "mooncake"])
    ap.add_argument("--quick", action="store_true", help="tiny variants, seconds")
    ap.add_argument("--instances", nargs="+", type=int, default=list(INSTANCES), help="mooncake: cluster sizes")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="mooncake: routers")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    out = {"experiment": "sim_repro", "git_sha": git_sha(), "quick": args.quick}
    text, plots = [], []
    t0 = time.time()
    if "router_blog" in args.parts:
        t = time.time()
        out["router_blog"] = part = router_blog(args.quick) | {"wall_s": None}
        part["wall_s"] = time.time() - t
        text.append("**router_blog**\n\n" + blog_markdown(part))
        plots.append(plot_blog(part, args.out / "plots" / "router_blog.png"))
    if "mooncake" in args.parts:
        t = time.time()
        out["mooncake"] = part = mooncake(args.quick, args.instances, args.policies)
        part["wall_s"] = time.time() - t
        text.append("**mooncake**\n\n" + mooncake_markdown(part))
        for n in dict.fromkeys(r["instances"] for r in part["rows"]):
            rows = [{**r, "contender": r["router"]} for r in part["rows"] if r["instances"] == n]
            plots.append(plot_workload(rows, f"mooncake_x{n}", part["ceiling_hit_rate"], args.out / "plots",
                                       title=f"the Mooncake conversation trace, {n} x DeepSeek-V2 (8 x H100, TP 8)"))
    out["wall_s"] = time.time() - t0
    out["plots"] = [str(p) for p in plots]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (args.out / "table.md").write_text("\n".join(text))
    print("\n".join(text))
    print(f"results: {args.out / 'results.json'}  plots: {', '.join(p.name for p in plots)}  ({out['wall_s']:.0f} s)")
    rows = [r for key in ("router_blog", "mooncake") if key in out for r in out[key]["rows"]]
    if any(r["requests_failed"] for r in rows):
        sys.exit("some requests failed: see requests_failed in results.json")


if __name__ == "__main__":
    main()
