"""Issue 21, round 5's one sourced size: how far a batch's expert loads scatter around the replayed distribution
(`sim.cost.expert_load_fluctuation`, plugins/cost/lib/load_fluctuation.py), fitted to a measured per-step
balancedness.

Source: lmsys blog 2025-05-05, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96
H100 GPUs", section "Ablation Study: EPLB / Case Study: Workload Imbalance Versus Overall Throughput": a decode run
with EPLB, 1,800 input and 100 output tokens, batch size 256, throughput per device and balancedness plotted per
decode step (the figure public/images/blog/large_scale_ep/eplb-throughput-vs-imbalance.png of
github.com/lm-sys/lm-sys.github.io at 01f4540, "figures (#145)", 2025-05-06; MIT License, Copyright (c) 2023 LMSYS
Org; kept as loads/sglang_blog_eplb_throughput_vs_imbalance.png). It measures loads, not the predicted throughputs
(1.49x, 2.54x, 50,302, 22,282). Read from the blog and SGLang's code, not the figure: the metric is SGLang's expert
distribution recorder's (expert_distribution.py, compute_utilization_rate: per layer, the mean GPU's picks over the
busiest GPU's, then the mean over the recorder's 61 layers, where the 3 dense layers record no picks and read
(0 + 1e-5) / (0 + 1e-5) = 1); the run is the blog's decode deployment (9 nodes, EP72, 32 redundant experts; its
~2,750-2,850 tok/s per device x 8 is the 22.3k per node of that setup), 256 requests per device.

What this script does:
1. reads the red curve (balancedness, right axis) at every decode step 13-89 off the PNG: the axis geometry below was
   measured on the PNG (the right axis's labels 0.775-0.900 centred at the rows given, the x grid lines at steps
   20, 40, 60, 80);
2. turns each step's logged value into the mean over the 58 MoE layers: (61 b - 3) / 58;
3. finds the inflation at which the cost model's load fluctuation gives the same mean balancedness for that run:
   the replayed decode distribution (loads/sglang_blog_decode.json), EPLB's placement of it over 288 slots on 72
   ranks (as the cost model places it), 256 x 72 tokens x top-8 picks per step (bisection on log inflation; the
   balancedness falls as the inflation grows);
and writes loads/sglang_blog_decode_balancedness.json (the steps read, their means, the fitted inflation).

    python experiments/wide_ep/fit_load_fluctuation.py    # ~10 s
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
from matplotlib.image import imread

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from plugins.cost.lib.expert_load import read_loads, rebalance  # noqa: E402
from plugins.cost.lib.load_fluctuation import LoadFluctuation  # noqa: E402

PNG = HERE / "loads" / "sglang_blog_eplb_throughput_vs_imbalance.png"
OUT = HERE / "loads" / "sglang_blog_decode_balancedness.json"
DECODE_LOADS = "experiments/wide_ep/loads/sglang_blog_decode.json"
SOURCE = ("lmsys blog 2025-05-05 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 "
          "H100 GPUs', 'Case Study: Workload Imbalance Versus Overall Throughput' (github.com/lm-sys/lm-sys.github.io, "
          "public/images/blog/large_scale_ep/eplb-throughput-vs-imbalance.png, commit 01f4540)")
LICENSE = "MIT (lm-sys/lm-sys.github.io LICENSE, Copyright (c) 2023 LMSYS Org)"
# pixel geometry of the 2667 x 1996 PNG
RIGHT_AXIS = ((558.0, 0.900), (1526.0, 0.775))    # label centres (rows) of the top and bottom balancedness ticks
X_STEP = ((631.0, 20), (1985.0, 80))               # grid-line columns of steps 20 and 80
PLOT_ROWS = (430, 1620)                            # inside the plot frame (the legend's marker sits above)
FIRST, LAST = 13, 89                               # the decode steps the curve spans
LAYERS, MOE_LAYERS = 61, 58                        # DeepSeek-V3: the recorder's layers, of which MoE
EP, SLOTS, PER_DEVICE, TOP_K = 72, 288, 256, 8     # the run: 9 nodes x 8 GPUs, 256 + 32 slots, batch, picks per token


def read_curve(img: np.ndarray) -> dict[int, float]:
    """Step -> balancedness: the red line's mean row in the step's column (3 pixels wide)."""
    red = (img[:, :, 0] > 0.8) & (img[:, :, 1] < 0.45) & (img[:, :, 2] < 0.4)
    (r0, v0), (r1, v1) = RIGHT_AXIS
    (c0, s0), (c1, s1) = X_STEP
    out = {}
    for step in range(FIRST, LAST + 1):
        x = int(round(c0 + (step - s0) * (c1 - c0) / (s1 - s0)))
        rows = np.nonzero(red[PLOT_ROWS[0]:PLOT_ROWS[1], x - 1:x + 2].any(axis=1))[0]
        if not len(rows):
            raise SystemExit(f"step {step}: no red pixel in column {x}: the geometry is off")
        y = PLOT_ROWS[0] + rows.mean()
        out[step] = v0 + (y - r0) * (v1 - v0) / (r1 - r0)
    return out


def fit(target: float) -> tuple[float, float]:
    """(inflation, the model's balancedness at it) for the run's placement and picks."""
    rows = read_loads(DECODE_LOADS, 256)
    placed = [rebalance(r, SLOTS, EP) for r in rows]
    picks = PER_DEVICE * EP * TOP_K

    def model(inflation: float) -> float:
        return LoadFluctuation(rows, placed, EP, inflation, 0).balancedness(picks)

    lo, hi = 0.0, math.log(1e4)                      # log inflation: 1 .. 10,000
    if not model(math.exp(hi)) < target < model(math.exp(lo)):
        raise SystemExit(f"the target {target:.4f} is outside the model's range at inflation 1 .. 1e4")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if model(math.exp(mid)) > target else (lo, mid)
    inflation = math.exp((lo + hi) / 2)
    return inflation, model(inflation)


def main() -> None:
    img = imread(PNG)[:, :, :3].astype(np.float64)
    logged = read_curve(img)
    moe = {s: (LAYERS * b - (LAYERS - MOE_LAYERS)) / MOE_LAYERS for s, b in logged.items()}
    target = float(np.mean(list(moe.values())))
    inflation, fitted = fit(target)
    out = {"source": SOURCE, "license": LICENSE, "png_sha256": hashlib.sha256(PNG.read_bytes()).hexdigest(),
           "method": "experiments/wide_ep/fit_load_fluctuation.py: the red curve read per decode step; "
                     "(61 b - 3) / 58 for the MoE layers; inflation bisected until plugins/cost/lib/"
                     "load_fluctuation.py's mean balancedness for the run equals the steps' mean",
           "run": {"ep": EP, "slots": SLOTS, "tokens_per_device": PER_DEVICE, "top_k": TOP_K,
                   "loads": DECODE_LOADS, "placement": "EPLB (global policy) for the loads"},
           "balancedness_logged": {str(s): round(v, 4) for s, v in logged.items()},
           "logged_mean": round(float(np.mean(list(logged.values()))), 4),
           "logged_min": round(min(logged.values()), 4), "logged_max": round(max(logged.values()), 4),
           "moe_layers_mean": round(target, 4),
           "inflation": round(inflation, 3), "model_balancedness_at_fit": round(fitted, 4)}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{OUT.relative_to(ROOT)}: steps {FIRST}-{LAST}, logged balancedness mean {out['logged_mean']} "
          f"(min {out['logged_min']}, max {out['logged_max']}), MoE layers {out['moe_layers_mean']}; "
          f"inflation {out['inflation']} (model {out['model_balancedness_at_fit']})")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
