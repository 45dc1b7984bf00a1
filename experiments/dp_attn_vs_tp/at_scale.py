"""DP attention vs TP at the design document's scale, in mode=sim: SGLang PR #1970's benchmark (DeepSeek-V2 shapes,
fp8 weights, 8 x H100, radix cache off, 10,000 prompts at once; conf/experiment/pr1970.yaml) beside the PR's figures.

Decode (input 1, output 512) and prefill (input 512, output 1), TP x8 and DP attention x8 (SGLang halves the chunked
prefill size under DP attention: 8,192 -> 4,096), priced by the roofline cost model. A second decode pair prices
the MLA decode kernel as reading each request's latent once for all heads (`sim.cost.decode_head_block=0`) instead
of once per 16-head block (SGLang v0.4's Triton kernel): how much of the DP/TP ratio that kernel accounts for.
Prints the table, writes results_at_scale.json and at_scale.png beside this file.

    python experiments/dp_attn_vs_tp/at_scale.py          # ~1 minute
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

# PR #1970's description (8 x H100, neuralmagic/DeepSeek-Coder-V2-Instruct-FP8, bench_serving random, 10,000 prompts)
PR = {("decode", "tp"): 6656.75, ("decode", "dp_attn"): 11174.62,
      ("prefill", "tp"): 17941.92, ("prefill", "dp_attn"): 21658.78}
SCHEMES = {"tp": ["parallel=tp", "engine.chunked_prefill_tokens=8192"],
           "dp_attn": ["parallel=dp_attn", "engine.chunked_prefill_tokens=4096"]}
BENCHES = {"decode": [], "prefill": ["workload.input_len=512", "workload.output_len=1"]}
VARIANTS = {"sglang_v0.4": [], "latent_read_once": ["sim.cost.decode_head_block=0"]}
KEYS = ("kv_capacity_tokens_instance", "max_running_requests", "tpot_p50_ms", "duration_s", "sim_wall_s")


def cell(bench: str, scheme: str, variant: str) -> dict:
    results, _ = simulate(compose(["experiment=pr1970"] + SCHEMES[scheme] + BENCHES[bench] + VARIANTS[variant]))
    key = "output_throughput_tok_s" if bench == "decode" else "input_throughput_tok_s"
    row = {"bench": bench, "scheme": scheme, "variant": variant, "tok_s": results[key],
           **{k: results[k] for k in KEYS}, "pr_tok_s": PR[bench, scheme] if variant == "sglang_v0.4" else None}
    row["error"] = row["tok_s"] / row["pr_tok_s"] - 1 if row["pr_tok_s"] else None
    return row


def main() -> None:
    rows = [cell(b, s, v) for b in BENCHES for v in VARIANTS for s in SCHEMES if b == "decode" or v == "sglang_v0.4"]
    ratios = []
    print("| bench | variant | scheme | sim tok/s | PR tok/s | error | KV tokens / instance | peak running | "
          "TPOT p50 ms | sim wall s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pr = f"{r['pr_tok_s']:,.0f}" if r["pr_tok_s"] else "-"
        err = f"{r['error']:+.0%}" if r["error"] is not None else "-"
        print(f"| {r['bench']} | {r['variant']} | {r['scheme']} | {r['tok_s']:,.0f} | {pr} | {err} | "
              f"{r['kv_capacity_tokens_instance']:,} | {r['max_running_requests']:,} | {r['tpot_p50_ms']:.1f} | "
              f"{r['sim_wall_s']:.1f} |")
    for b in BENCHES:
        for v in VARIANTS:
            pair = {r["scheme"]: r["tok_s"] for r in rows if r["bench"] == b and r["variant"] == v}
            if len(pair) == 2:
                pr = PR[b, "dp_attn"] / PR[b, "tp"]
                sim = pair["dp_attn"] / pair["tp"]
                ratios.append({"bench": b, "variant": v, "sim_ratio": sim, "pr_ratio": pr, "error": sim / pr - 1})
    print("\nDP attention / TP:")
    for r in ratios:
        print(f"  {r['bench']:8s} {r['variant']:17s} sim {r['sim_ratio']:.2f}x  PR {r['pr_ratio']:.2f}x  "
              f"error {r['error']:+.0%}" + ("  (blog: up to 1.9x)" if r["bench"] == "decode" else ""))
    out = {"experiment": "dp_attn_vs_tp/at_scale", "config": "conf/experiment/pr1970.yaml", "git_sha": git_sha(),
           "rows": rows, "ratios": ratios}
    (HERE / "results_at_scale.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows)
    print(f"results: {HERE / 'results_at_scale.json'}, plot: {HERE / 'at_scale.png'}")


def plot(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, bench in zip(axes, BENCHES):
        base = [r for r in rows if r["bench"] == bench and r["variant"] == "sglang_v0.4"]
        xs = range(len(base))
        ax.bar([x - 0.2 for x in xs], [r["pr_tok_s"] for r in base], 0.4, label="PR #1970 (measured)")
        ax.bar([x + 0.2 for x in xs], [r["tok_s"] for r in base], 0.4, label="servelab mode=sim (roofline)")
        ax.set_xticks(list(xs), [r["scheme"] for r in base])
        ax.set_title(f"{bench}: DeepSeek-V2 fp8, 8 x H100")
        ax.set_ylabel("tok/s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "at_scale.png", dpi=120)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
