"""Compare the prediction (predictions.json, written by predict.py and committed before this file was run on it) with
Splitwise's published figure, write comparison.json and print the table. The published figure lives here only.

    python experiments/pd_splitwise/compare.py [--round 2]   # round 2: predictions_round2.json -> comparison_round2.json
    python experiments/pd_splitwise/compare.py --round 2 --design ha|isocost   # held-out designs (predict.py's):
        # predictions_round2_{ha,isocost}.json -> comparison_round2_{ha,isocost}.json

The issue's bar: the published ratio (Splitwise-AA's throughput over Baseline-A100's, iso-power, conversation trace,
BLOOM-176B) within 15%; the held-out designs' ratios (Splitwise-HA over Baseline-A100, iso-power; Splitwise-AA over
Baseline-H100, iso-cost) against the same bar.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.15

PUBLISHED = {
    "source": "Patel et al., Splitwise: Efficient Generative LLM Inference Using Phase Splitting, ISCA'24 "
              "(arXiv:2311.18677), section 6.2 'Iso-power throughput-optimized clusters', paragraph 'Summary plot' "
              "(Figure 18a, conversation trace, BLOOM-176B): 'Compared to Baseline-A100, Splitwise-AA delivers "
              "2.15x more throughput at the same power and cost. Splitwise-HA delivers 1.18x more throughput at 10% "
              "lower cost and the same power.'",
    "read_from": "a markdown transcription of the paper found in the public code index (the ar5iv page reachable "
                 "here gave its abstract only); the same 2.15x is quoted by independent summaries there",
    "splitwise_aa_over_baseline_a100": 2.15,
    "context": {
        "abstract": "up to 1.4x higher throughput at 20% lower cost, or 2.35x more throughput under the same power and "
                    "cost budgets (other designs and baselines)",
        "provisioning": "70 DGX-A100 under 40 DGX-H100's power (section 6.2); Splitwise-AA (45P, 25T) for the "
                        "conversation trace (splitwise-sim notebooks/plots.ipynb isopower_conv_configs)",
    },
}


# Held-out designs (predict.py --design): each published ratio, the prediction's key for it, and the rows to print.
PAPER = ("Patel et al., Splitwise: Efficient Generative LLM Inference Using Phase Splitting, ISCA'24 "
         "(arXiv:2311.18677)")
PUBLISHED_DESIGNS = {
    "ha": {
        "source": f"{PAPER}, section 6.2 'Iso-power throughput-optimized clusters', paragraph 'Summary plot' (Figure "
                  "18a, conversation trace, BLOOM-176B): 'Compared to Baseline-A100, Splitwise-AA delivers 2.15x more "
                  "throughput at the same power and cost. Splitwise-HA delivers 1.18x more throughput at 10% lower "
                  "cost and the same power.'",
        "read_from": PUBLISHED["read_from"],
        "splitwise_ha_over_baseline_a100": 1.18,
        "context": {
            "not_compared": "'at 10% lower cost and the same power': the clusters' cost and power follow from their "
                            "machine counts, not from the simulation",
            "provisioning": "Splitwise-HA (25P on DGX-H100, 26T on DGX-A100) against Baseline-A100 (70) for the "
                            "conversation trace (splitwise-sim notebooks/plots.ipynb isopower_conv_configs)",
        },
    },
    "isocost": {
        "source": f"{PAPER}, section 6.3 'Other cluster optimizations', paragraph 'Iso-cost throughput-optimized' "
                  "(Figure 18b, conversation trace, BLOOM-176B): 'Figure 18b shows the summary plot for iso-cost "
                  "clusters, with their space, throughput, and power requirements. We find that Splitwise-AA provides "
                  "the best throughput for the same cost, namely 1.4x more throughput than Baseline-H100, running at "
                  "25% more power, and 2x the space. This is an interesting operational point for most customers who "
                  "may not care about power and space, instead preferring the 40% higher throughput using older, more "
                  "easily available GPUs.'",
        "read_from": PUBLISHED["read_from"],
        "splitwise_aa_over_baseline_h100": 1.4,
        "context": {
            "not_compared": "'running at 25% more power, and 2x the space': the clusters' power and space follow from "
                            "their machine counts, not from the simulation",
            "provisioning": "Splitwise-AA (51P, 35T on DGX-A100) against Baseline-H100 (40) for the conversation trace "
                            "(splitwise-sim notebooks/plots.ipynb isocost_conv_configs)",
        },
    },
}
# design -> (published, the published ratio's key, the prediction's ratio key, (row label, prediction key) per system)
DESIGNS = {
    "aa": (PUBLISHED, "splitwise_aa_over_baseline_a100", "splitwise_aa_over_baseline",
           (("Baseline-A100", "baseline_a100_req_s"), ("Splitwise-AA", "splitwise_aa_req_s"))),
    "ha": (PUBLISHED_DESIGNS["ha"], "splitwise_ha_over_baseline_a100", "splitwise_ha_over_baseline_a100",
           (("Baseline-A100", "baseline_a100_req_s"), ("Splitwise-HA", "splitwise_ha_req_s"))),
    "isocost": (PUBLISHED_DESIGNS["isocost"], "splitwise_aa_over_baseline_h100", "splitwise_aa_over_baseline_h100",
                (("Baseline-H100", "baseline_h100_req_s"), ("Splitwise-AA", "splitwise_aa_req_s"))),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round", type=int, default=1, choices=(1, 2), help="which round's prediction (predict.py's)")
    ap.add_argument("--design", default="aa", choices=tuple(DESIGNS),
                    help="which pair of clusters (predict.py --design; ha and isocost: with --round 2)")
    args = ap.parse_args(argv)
    if args.design != "aa" and args.round != 2:
        print(f"compare.py: --design {args.design} is round 2's (predict.py --round 2 --design {args.design}): add "
              f"--round 2", file=sys.stderr)
        return 2
    suffix = "" if args.round == 1 else "_round2" + ("" if args.design == "aa" else f"_{args.design}")
    path = HERE / f"predictions{suffix}.json"
    if not path.exists():
        print(f"compare.py: {path.name} does not exist (predict.py writes it)", file=sys.stderr)
        return 2
    source, published_key, ratio_key, rows = DESIGNS[args.design]
    pred = json.loads(path.read_text())["predicted"]
    ratio, published = pred[ratio_key], source[published_key]
    err = ratio / published - 1
    within = abs(err) <= TOLERANCE
    print(f"{path.name} against {source['source']}\n")
    print(f"{'figure':<44} {'published':>10} {'predicted':>10}")
    for label, key in rows:
        print(f"{label + ' throughput within SLOs (req/s)':<44} {'-':>10} {pred[key]:>10}")
    print(f"{rows[1][0] + ' / ' + rows[0][0]:<44} {published:>10.2f} {ratio:>10.3f}")
    print(f"\nthe ratio within {TOLERANCE:.0%} of the published one: {'yes' if within else 'NO'} ({err:+.1%})")
    out = {"prediction_file": path.name, "published": source, "predicted": pred, "ratio_error": err,
           "within_tolerance": within}
    (HERE / f"comparison{suffix}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
