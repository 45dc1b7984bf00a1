"""Compare a round's prediction (written by predict.py and committed before this file was run on it) with DistServe's
published figures, write comparison_round<N>.json and print the table. The published figures live here only.

    python experiments/pd_repro/compare.py --round 1     # predictions.json (round 1, commit 7b49e78)
    python experiments/pd_repro/compare.py --round 2     # predictions_round2.json (commit b7ad40b)
    python experiments/pd_repro/compare.py --round 3     # predictions_round3.json (commit 7edb041)
    python experiments/pd_repro/compare.py --round 4     # predictions_round4.json (commit 8bcf1df)

The issue's bar: the published ratio (DistServe's per-GPU goodput over vLLM's, OPT-13B chatbot) within 15%.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.15
NOTEBOOK = ("LLMServe/DistServe, evaluation/2-benchmark-serving/plot.ipynb at commit e2d4dca (2024-06-06, "
            "'[camera-ready] reorganize folder structure'), the authors' own run of the notebook that draws Figure 8")

PUBLISHED = {
    "source": "Zhong et al., DistServe, OSDI'24, Figure 8 top row, OPT-13B chatbot panel (ShareGPT, SLO TTFT 0.25 s / "
              "TPOT 0.1 s, goodput = the per-GPU rate where 90% of requests meet both); the figures below are printed "
              "in " + NOTEBOOK,
    "opt13b_chatbot": {
        # cell `plot_fig8_upper(90)`, its printed output, first panel (opt-13b-sharegpt), second line:
        # "Improvement (DistServe compared to vLLM): 4.6" (first_inter_x / inter_x of the two 90% crossings)
        "distserve_over_vllm": 4.6,
        # cell `plot_fig8_upper(99)` prints vLLM's OPT-13B attainment series at per-GPU rates
        # [0.25, 0.5, 1, 1.5, 2, 2.25, 2.5, 3]: [90, 90, 85, 81, 71, 70, 68, 55] %; the notebook's find_intersection
        # on it at 90% gives 0.5 req/s/GPU (the series stays at 90 through 0.5 and falls below between 0.5 and 1).
        # Derived, not printed as such: the same data files are assumed behind both cells.
        "vllm_goodput_per_gpu": 0.5,
        "distserve_goodput_per_gpu": 4.6 * 0.5,   # the printed ratio x vLLM's derived crossing
        "derivation": "ratio printed; vLLM's 0.5 is find_intersection over the printed attainment series; "
                      "DistServe's is their product",
    },
    "context": {
        "opt13b_vs_deepspeed_mii": "7.36x (the same cell's first line; the OSDI abstract's '7.4x more requests')",
        "opt66b_vs_vllm": "2.75x, opt175b_vs_vllm: 1.99x (the same cell; the chatbot range 2.0x-4.6x)",
        "arxiv_v1_and_blog": "up to 4.48x goodput or 10.2x tighter SLO (all models, applications and SLOs)",
    },
}


def prediction_file(rnd: int) -> Path:
    return HERE / ("predictions.json" if rnd == 1 else f"predictions_round{rnd}.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--round", type=int, default=1)
    args = ap.parse_args(argv)
    path = prediction_file(args.round)
    if not path.exists():
        print(f"compare.py: {path.name} does not exist (predict.py --round {args.round} writes it)", file=sys.stderr)
        return 2
    pred = json.loads(path.read_text())["predicted"]
    pub = PUBLISHED["opt13b_chatbot"]
    rows = [("vLLM goodput (req/s/GPU)", pub["vllm_goodput_per_gpu"], pred["vllm_goodput_per_gpu"]),
            ("DistServe goodput (req/s/GPU)", pub["distserve_goodput_per_gpu"], pred["distserve_goodput_per_gpu"]),
            ("DistServe / vLLM", pub["distserve_over_vllm"], pred["distserve_over_vllm"])]
    print(f"round {args.round}: {path.name} against {PUBLISHED['source']}\n")
    print(f"{'figure':<32} {'published':>10} {'predicted':>10} {'error':>8}")
    for name, p, s in rows:
        print(f"{name:<32} {p:>10.3f} {s:>10.3f} {s / p - 1:>+8.1%}")
    err = pred["distserve_over_vllm"] / pub["distserve_over_vllm"] - 1
    within = abs(err) <= TOLERANCE
    print(f"\nthe ratio within {TOLERANCE:.0%} of the published one: {'yes' if within else 'NO'} ({err:+.1%})")
    out = {"round": args.round, "prediction_file": path.name, "published": PUBLISHED, "predicted": pred,
           "errors": {name: s / p - 1 for name, p, s in rows}, "ratio_error": err, "within_tolerance": within}
    (HERE / f"comparison_round{args.round}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
