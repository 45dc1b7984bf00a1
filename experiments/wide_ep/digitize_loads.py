"""Issue 21, round 2's expert-load source: DeepSeek-V3's expert distribution as SGLang's large-scale-EP blog
published it, read off the figure's pixels into replayable loads files for the simulator
(`sim.cost.expert_loads=experiments/wide_ep/loads/sglang_blog_{prefill,decode}.json`).

Source: lmsys blog 2025-05-05, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96
H100 GPUs", section "Ablation Study: EPLB / Case Study: Expert Distribution Statistics": the figure
public/images/blog/large_scale_ep/eplb-stat.png of github.com/lm-sys/lm-sys.github.io (commit 2db4e40, MIT License,
Copyright (c) 2023 LMSYS Org), kept here as loads/sglang_blog_eplb_stat.png. Two heat maps, prefill and decode:
61 layers (rows 0-60; 0-2 are DeepSeek-V3's dense layers) x 256 routed experts, each cell an expert's share of the
layer's routed picks on one shared colour bar from 0.000 to 0.040 (white to green).

How it is read: each cell's centre (3 x 3 pixels) is matched to the nearest colour of the colour bar, whose value
follows from its tick marks; white is 0. The geometry below was measured on the PNG (tick marks' pixel rows and
columns). The checks: the three dense layers read 0 and every MoE layer's 256 values sum to the same total within
1% (0.82 prefill, 1.04 decode: near-white shades are coarse, so the totals are not exactly 1). Each layer is then
normalised to shares summing to 1; a placement's max/mean rank load does not depend on the scale. The colour bar
tops out at 0.0408: a cell at that value may be clipped (one per panel). The map is a sample's accumulated
distribution, as EPLB consumes it; per-batch fluctuation is not in it.

    python experiments/wide_ep/digitize_loads.py      # ~5 s; rewrites loads/sglang_blog_{prefill,decode}.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
from matplotlib.image import imread

HERE = Path(__file__).resolve().parent
PNG = HERE / "loads" / "sglang_blog_eplb_stat.png"
SOURCE = ("lmsys blog 2025-05-05 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 "
          "H100 GPUs', figure 'Expert Distribution Statistics' (github.com/lm-sys/lm-sys.github.io, "
          "public/images/blog/large_scale_ep/eplb-stat.png, commit 2db4e40)")
LICENSE = "MIT (lm-sys/lm-sys.github.io LICENSE, Copyright (c) 2023 LMSYS Org)"
LAYERS, EXPERTS, DENSE = 61, 256, 3          # DeepSeek-V3: 61 layers, the first 3 dense, 256 routed experts
# pixel geometry of the 1961 x 1147 PNG: cell centres from the axes' tick marks
X0, DX = 176.5, 5.812                        # expert 0's column, pixels per expert (ticks 0..250 at 176.5..1629.5)
Y0 = {"prefill": 124.5, "decode": 628.5}     # layer 0's row in each panel (ticks 0, 20, 40, 60 every 116.33 px)
DY = 5.8167
BAR_COLS, BAR_ROWS = (1760, 1778), (276, 826)  # inside the colour bar's frame
BAR_ZERO_ROW, BAR_ROWS_PER_UNIT = 827.5, 67.625 / 0.005   # tick 0.000 at row 827.5, 0.005 per 67.625 rows


def colour_bar(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.arange(*BAR_ROWS)
    colours = np.vstack([img[rows, BAR_COLS[0]:BAR_COLS[1]].mean(axis=1), [[1.0, 1.0, 1.0]]])
    values = np.append((BAR_ZERO_ROW - rows) / BAR_ROWS_PER_UNIT, 0.0)
    return colours, values


def read_panel(img: np.ndarray, phase: str) -> np.ndarray:
    """[layer, expert] values as the colour bar reads them."""
    colours, values = colour_bar(img)
    out = np.zeros((LAYERS, EXPERTS))
    for layer in range(LAYERS):
        y = int(round(Y0[phase] + DY * layer))
        for e in range(EXPERTS):
            x = int(round(X0 + DX * e))
            pixel = img[y - 1:y + 2, x - 1:x + 2].reshape(-1, 3).mean(axis=0)
            out[layer, e] = values[((colours - pixel) ** 2).sum(axis=1).argmin()]
    return out


def check(raw: np.ndarray, phase: str) -> dict:
    totals = raw[DENSE:].sum(axis=1)
    if raw[:DENSE].any():
        raise SystemExit(f"{phase}: the dense layers 0-{DENSE - 1} should read 0: the geometry is off")
    if totals.min() <= 0 or totals.max() / totals.min() > 1.01:
        raise SystemExit(f"{phase}: MoE layers' totals {totals.min():.3f}..{totals.max():.3f} differ by over 1%")
    return {"raw_layer_total_min": round(float(totals.min()), 4), "raw_layer_total_max": round(float(totals.max()), 4),
            "cells_at_bar_top": int((raw >= values_top()).sum())}


def values_top() -> float:
    return (BAR_ZERO_ROW - BAR_ROWS[0]) / BAR_ROWS_PER_UNIT - 1e-9


def main() -> None:
    img = imread(PNG)[:, :, :3].astype(np.float64)
    digest = hashlib.sha256(PNG.read_bytes()).hexdigest()
    for phase in Y0:
        raw = read_panel(img, phase)
        checks = check(raw, phase)
        shares = raw[DENSE:] / raw[DENSE:].sum(axis=1, keepdims=True)
        out = {"source": SOURCE, "license": LICENSE, "phase": phase, "png_sha256": digest,
               "method": "experiments/wide_ep/digitize_loads.py: each cell's colour matched to the colour bar, "
                         "every MoE layer normalised to shares summing to 1", "checks": checks,
               "expert_load": {f"layer{DENSE + i}": [round(float(v), 6) for v in row] for i, row in enumerate(shares)}}
        path = HERE / "loads" / f"sglang_blog_{phase}.json"
        path.write_text(json.dumps(out) + "\n")
        top = shares.max(axis=1) * EXPERTS
        print(f"{phase}: {path.relative_to(HERE.parents[1])}  layers {DENSE}-{LAYERS - 1}, raw totals "
              f"{checks['raw_layer_total_min']}-{checks['raw_layer_total_max']}, hottest expert {np.median(top):.1f}x "
              f"the mean (median over layers), {checks['cells_at_bar_top']} cell(s) at the bar's top")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
