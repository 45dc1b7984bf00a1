"""The study nobody has published (issue 20, item 7): prefill:decode ratio x disaggregation decider x routing policy
on the Mooncake conversation trace, in mode=sim at 64 instances, goodput at a stated SLO.

Setup (experiment=mooncake_trace's: DeepSeek-V2 bf16 instances on 8 x H100 SXM each with TP 8, moe=triton_fused,
sim.cost=roofline, the trace's 512-token blocks and real output lengths), at 64 instances the trace's clock 8x faster
(8 instances serve it at its own clock: experiments/sim_repro), the first --requests requests. Cells:

- P:D: 64 mixed instances (the baseline), or 16:48, 32:32, 48:16 prefill:decode (cluster.roles; instances fill
  8-GPU nodes in order, prefill ones first, so every transfer crosses the NICs: hardware.inter_node_gb_s);
- decider: always (sglang-router's P/D mode), decode_first at 512 and 4096 uncached tokens (llm-d's rule;
  router.pd_local_prefill_max_tokens; the decode instance prefills the rest itself);
- policy: round_robin, cache_aware (SGLang's router's; the decider reads its cache estimate).

SLO: TTFT <= 2 s and TPOT <= 100 ms (this study's choice: 100 ms is the TBT bound Mooncake's paper serves; 2 s a
chat's first-token wait). Goodput: requests meeting both per second of the run (vLLM's definition, as every run's).

    python experiments/pd_study/run.py [--requests 1200] [--speedup 8] [--quick]
        # results-<speedup>x.json, table-<speedup>x.md, plots/goodput-<speedup>x.png
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
from framework.runs.sim import simulate  # noqa: E402

INSTANCES = 64
SLO = ["workload.slo.ttft_ms=2000", "workload.slo.tpot_ms=100"]
RATIOS = {"mixed": None, "16:48": 16, "32:32": 32, "48:16": 48}
DECIDERS = {"always": ["router.pd_decider=always"],
            "decode_first@512": ["router.pd_decider=decode_first", "router.pd_local_prefill_max_tokens=512"],
            "decode_first@4096": ["router.pd_decider=decode_first", "router.pd_local_prefill_max_tokens=4096"]}
POLICIES = ("round_robin", "cache_aware")
KEYS = ("goodput_req_s", "slo_attainment", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
        "request_throughput_req_s", "cache_hit_rate", "pd_transfers", "pd_local_prefills", "pd_transfer_p50_s",
        "pd_transfer_p99_s", "sim_wall_s")


def cells(quick: bool):
    for policy in POLICIES[:1] if quick else POLICIES:
        for ratio, prefill in RATIOS.items():
            if prefill is None:
                yield policy, ratio, "-", []
                continue
            roles = ["prefill"] * prefill + ["decode"] * (INSTANCES - prefill)
            for name, decider in DECIDERS.items():
                yield policy, ratio, name, [f"cluster.roles=[{','.join(roles)}]",
                                            "engine.disaggregation_local_prefill=true", *decider]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--quick", action="store_true", help="round_robin only, 400 requests (a smoke run)")
    ap.add_argument("--speedup", type=float, default=INSTANCES / 8,
                    help="the trace's clock x this (default 8: 64 instances as 8 at the trace's own clock)")
    args = ap.parse_args()
    tag = f"{args.speedup:g}x"
    n = 400 if args.quick else args.requests
    base = ["experiment=mooncake_trace", f"cluster.instances={INSTANCES}", f"workload.num_requests={n}",
            f"workload.time_scale={args.speedup:g}", *SLO]
    rows = []
    for policy, ratio, decider, extra in cells(args.quick):
        t0 = time.time()
        res, _ = simulate(compose(base + [f"router={policy}", *extra]))
        row = {"policy": policy, "pd": ratio, "decider": decider, **{k: res.get(k) for k in KEYS}}
        rows.append(row)
        print(f"{policy:>12} {ratio:>6} {decider:>18}  goodput {row['goodput_req_s']:7.2f} req/s  attainment "
              f"{row['slo_attainment']:.3f}  TTFT p90 {row['ttft_p90_ms']:8.0f} ms  TPOT p90 {row['tpot_p90_ms']:6.1f} "
              f"ms  ({time.time() - t0:.0f} s)", flush=True)
    out = {"setup": {"base": base, "slo": SLO, "instances": INSTANCES, "requests": n, "speedup": args.speedup},
           "rows": rows}
    (HERE / f"results-{tag}.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| policy | P:D | decider | goodput (req/s) | SLO attainment | TTFT p90 (ms) | TPOT p90 (ms) | hit rate | "
             "local prefills |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['pd']} | {r['decider']} | {r['goodput_req_s']:.2f} | "
                     f"{r['slo_attainment']:.3f} | {r['ttft_p90_ms']:.0f} | {r['tpot_p90_ms']:.1f} | "
                     f"{r['cache_hit_rate']:.3f} | {r['pd_local_prefills'] or 0} |")
    (HERE / f"table-{tag}.md").write_text("\n".join(lines) + "\n")
    plot(rows, tag)
    print("\n".join(lines))


def plot(rows, tag: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    (HERE / "plots").mkdir(exist_ok=True)
    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(1, len(policies), figsize=(6 * len(policies), 4), squeeze=False)
    for ax, policy in zip(axes[0], policies):
        mine = [r for r in rows if r["policy"] == policy]
        mixed = next(r["goodput_req_s"] for r in mine if r["pd"] == "mixed")
        ratios = [k for k in RATIOS if k != "mixed"]
        for j, decider in enumerate(DECIDERS):
            ys = [next(r["goodput_req_s"] for r in mine if r["pd"] == k and r["decider"] == decider) for k in ratios]
            ax.bar([i + (j - 1) * 0.27 for i in range(len(ratios))], ys, 0.27, label=decider)
        ax.axhline(mixed, color="k", ls="--", label="64 mixed")
        ax.set_xticks(range(len(ratios)), ratios)
        ax.set_xlabel("prefill:decode instances")
        ax.set_ylabel("goodput (req/s, TTFT <= 2 s, TPOT <= 100 ms)")
        ax.set_title(f"router={policy}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.suptitle(f"Mooncake conversation trace, 64 DeepSeek-V2 instances (TP 8, H100), trace clock x{tag[:-1]}")
    fig.tight_layout()
    fig.savefig(HERE / "plots" / f"goodput-{tag}.png", dpi=120)


if __name__ == "__main__":
    main()
