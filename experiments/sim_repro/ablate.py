"""Which term moves which predicted cell by how much (issue 19, item 10): predict.py's six cells with the round's
model, then with one of issue 19's terms switched off at a time. No published figure is read here.

    python experiments/sim_repro/ablate.py --round 1      # ~10 minutes; writes ablation_round<N>.json and .md
    python experiments/sim_repro/ablate.py --round 2      # round 1's terms and round 2's (ROUND2), on round 2's setup
    python experiments/sim_repro/ablate.py --round 3      # and round 3's (ROUND3), on round 3's setup
    python experiments/sim_repro/ablate.py --round 4      # and round 4's (ROUND4), on round 4's setup
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.core.paths import git_sha, load_script  # noqa: E402
from plugins.cost.roofline import RooflineConfig  # noqa: E402  (round 3's host terms: the defaults)

predict = load_script("experiments/sim_repro/predict.py")
BENCHES, ROUTERS, SCHEMES, pr1970, router_blog = (predict.BENCHES, predict.ROUTERS, predict.SCHEMES, predict.pr1970,
                                                  predict.router_blog)

TERMS = {"all terms (the prediction)": [],
         "no scheduler CPU": ["sim.cost.host_step_us=0", "sim.cost.host_running_us=0", "sim.cost.host_new_req_us=0",
                              "sim.cost.host_output_token_us=0", "sim.cost.host_new_token_us=0"],
         "no eager floor (launches x 5 us)": ["sim.cost.eager_floor=false"],
         "one-stage MLA decode": ["sim.cost.mla_decode_kv_splits=0"],
         "no fp8 activation quantization": ["sim.cost.fp8_act_quant=false"],
         "no front end": ["sim.cost.frontend=false"],
         "no BOS": ["workload.bos=false"],
         "v0.4.0's graph cap 96 under DP attention": ["engine.cuda_graph_dp_attention_max_bs=96"]}
# round 2's terms (predict.py SETUPS[2]), each undone alone: (overrides of every PR #1970 cell, of its DP cells only)
ROUND2 = {"v0.4.1's split-KV decode kernel (PR #2394) instead of the one before": (
              ["sim.cost.mla_decode_kernel=split_kv"], []),
          "that kernel's occupancy terms off (waves, spills: its bytes only)": (
              ["sim.cost.mla_decode_occupancy=false"], []),
          "CUDA graphs under DP attention (PR #2061)": ([], ["engine.cuda_graph=true"]),
          "schedule_conservativeness 0.3 under DP attention (PR #2096)": (
              [], ["parallel.schedule_conservativeness=0.3"])}
# round 3's term (predict.py SETUPS[3]), undone; and how it reads a call past the published rows
ROUND3 = {"the fitted GEMM rates for the fused MoE (round 2's) instead of its published rates": (
              ["sim.cost.fused_moe_rates=false"], []),
          "sensitivity, not a term: its rates past the published rows by their trend (fused_moe_rates_past=extend)": (
              ["sim.cost.fused_moe_rates_past=extend"], [])}
# round 4's terms (predict.py host_2024, every cell), undone: round 3's values back, whole or in part
SCHEDULER_R3 = [f"sim.cost.{k}={getattr(RooflineConfig, k)}" for k in
                ("host_step_us", "host_running_us", "host_new_req_us", "host_output_token_us", "host_new_token_us")]
FRONT_END_R3 = [f"sim.cost.{k}={getattr(RooflineConfig, k)}" for k in
                ("stream_us_per_chunk", "stream_us_per_output_token", "tokenize_us_per_token",
                 "tokenize_us_per_request")]
ROUND4 = {"round 3's host and front end (servelab's scheduler, 8 us a chunk) instead of sglang 0.3.5's measured": (
              SCHEDULER_R3 + FRONT_END_R3, []),
          "sglang 0.3.5's scheduler, round 3's front end": (FRONT_END_R3, []),
          "sglang 0.3.5's front end, round 3's scheduler": (SCHEDULER_R3, []),
          "no growth with the output streamed so far (both per-output-token terms 0)": (
              ["sim.cost.host_output_token_us=0", "sim.cost.stream_us_per_output_token=0"], [])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round", type=int, default=1)
    args = ap.parse_args()
    t0, rows = time.time(), []
    terms = {t: (extra, []) for t, extra in TERMS.items()} | (ROUND2 if args.round >= 2 else {}) \
        | (ROUND3 if args.round >= 3 else {}) | (ROUND4 if args.round >= 4 else {})   # rounds 5-6: round 4's
    for term, (extra, dp_extra) in terms.items():
        every_cell = term in TERMS or term in ROUND4      # round 2's and 3's terms are PR #1970's alone
        cells = ([pr1970(b, s, extra + (dp_extra if s == "dp_attn" else []), args.round)
                  for b in BENCHES for s in SCHEMES]
                 + [router_blog(r, extra if every_cell else [], args.round) for r in ROUTERS])
        rows.append({"term": term, "overrides": extra, "dp_attn_overrides": dp_extra,
                     "figures": {c["cell"]: c["figure"] for c in cells}})
        print(f"  {term:<42} " + "  ".join(f"{c['figure']:9,.0f}" for c in cells), flush=True)
    base = rows[0]["figures"]
    lines = [f"# Ablation, round {args.round}: each cell with one term off (change vs the prediction)", "",
             "| term off | " + " | ".join(base) + " |", "|---|" + "---:|" * len(base)]
    for r in rows:
        lines.append(f"| {r['term']} | " + " | ".join(
            f"{v:,.0f}" + ("" if r is rows[0] else f" ({v / base[c] - 1:+.0%})") for c, v in r["figures"].items()) + " |")
    out = {"experiment": "sim_repro/ablate", "round": args.round, "git_sha": git_sha(), "rows": rows,
           "wall_s": time.time() - t0}
    (HERE / f"ablation_round{args.round}.json").write_text(json.dumps(out, indent=1) + "\n")
    (HERE / f"ablation_round{args.round}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
