"""One figure per workload: hit rate against the ceiling, the router's estimate beside it, TTFT p50 / p99, and
output throughput, per contender (servelab's policies, then SGLang's router, hatched). Horizontal bars, the
contenders named once on the left, three panels in a row (about 1,800 x 600 px: readable on a screen).

    python experiments/routing_study/plot.py [results.json] [--out plots/]    # redraw from a stored study
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

HERE = Path(__file__).resolve().parent
DPI = 110


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_workload(rows: list[dict], workload: str, ceiling: float, out_dir: Path,
                  title: str = "4 workers (hatched: SGLang's router 0.3.2)") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [r["contender"] for r in rows]
    y = np.arange(len(rows))
    hatch = ["//" if "/" in c else "" for c in labels]
    fig, (hit, ttft, tput) = plt.subplots(1, 3, sharey=True, layout="constrained",
                                          figsize=(16.0, min(2.0 + 0.36 * len(rows), 20.0)))
    hit.barh(y - 0.2, [r["cache_hit_rate"] for r in rows], 0.4, color="tab:green", hatch=hatch, label="measured")
    est = [r.get("router_estimated_hit_rate") for r in rows]
    hit.barh(y + 0.2, [e if _finite(e) else 0 for e in est], 0.4, color="tab:olive", alpha=0.6,
             label="router's estimate")
    hit.axvline(ceiling, color="black", ls="--", lw=1, label=f"ceiling (one unbounded cache) {ceiling:.2f}")
    hit.set(xlabel="cache hit rate (cached / prompt tokens)", xlim=(0, 1), title="Hit rate")
    ttft.barh(y, [r["ttft_p50_ms"] for r in rows], 0.6, color="tab:blue", hatch=hatch, label="TTFT p50")
    ttft.plot([r["ttft_p99_ms"] for r in rows], y, "|", color="black", markersize=14, mew=2, label="TTFT p99")
    ttft.set(xlabel="TTFT (ms)", title="Time to first token")
    tput.barh(y, [r["output_throughput_tok_s"] for r in rows], 0.6, color="tab:orange", hatch=hatch)
    tput.set(xlabel="output tokens / s", title="Throughput")
    hit.set_yticks(y, labels, fontsize=9)
    hit.invert_yaxis()                                  # shared: the table's order, top to bottom
    for ax in (ttft, tput):
        ax.xaxis.set_major_locator(MaxNLocator(6))                 # 40,000 tok/s: labels with room between
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))
    for ax in (hit, ttft, tput):
        ax.grid(axis="x", alpha=0.3)
    handles = [*hit.get_legend_handles_labels()[0], *ttft.get_legend_handles_labels()[0]]
    if any(hatch):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="SGLang's router"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(f"{workload}: {title}", fontsize=11)
    path = out_dir / f"{workload}.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def redraw(results: Path, out_dir: Path) -> list[Path]:
    """The study's figures again from its results.json (its median rows and each workload's ceiling)."""
    rows = json.loads(results.read_text())["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    return [plot_workload(mine := [r for r in rows if r["workload"] == w], w, mine[0]["ceiling_hit_rate"], out_dir)
            for w in workloads]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, default=HERE / "results.json")
    ap.add_argument("--out", type=Path, default=HERE / "plots")
    args = ap.parse_args()
    print("wrote " + ", ".join(str(p) for p in redraw(args.results, args.out)))
