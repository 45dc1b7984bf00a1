"""One figure per router: per window, the hit rate, TTFT p99, the policy's state entries and its decision time;
the windows that replay trace A after a flush on the original workers ("same") are marked, and the operator's actions
named under the x axis.

    python experiments/soak/plot.py [results.json] [--out plots/]    # redraw from a stored soak
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def _op(row: dict) -> str:
    """The operator's action before the window, in one word."""
    words = row["action"].split()
    if row["window"] == 0:
        return "start"
    return (words[1] if words[0].startswith("sim://") else words[0]).rstrip(",")


def plot_router(rows: list[dict], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    router = rows[0]["router"]
    x = [r["window"] for r in rows]
    same = [r["window"] for r in rows if r["same"]]
    fig, axes = plt.subplots(4, 1, sharex=True, layout="constrained", figsize=(12, 9))
    panels = [("hit_rate", "hit rate", None), ("ttft_p99_ms", "TTFT p99 (ms, simulated)", None),
              ("state_entries", "policy state (entries)", None), ("decision_p50_us", "decision (us, CPU)",
                                                                   "decision_p99_us")]
    for ax, (key, label, second) in zip(axes, panels):
        ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label=key.replace("_", " "))
        if second:
            ax.plot(x, [r[second] for r in rows], marker=".", ms=3, alpha=0.6, label=second.replace("_", " "))
            ax.legend(loc="upper left", fontsize=8)
        ax.scatter(same, [r[key] for r in rows if r["same"]], s=40, facecolors="none", edgecolors="tab:red",
                   zorder=3)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        for r in rows:
            if r["trace"] == "B":
                ax.axvspan(r["window"] - 0.5, r["window"] + 0.5, color="tab:gray", alpha=0.12, lw=0)
    axes[0].set_ylim(0, 1)
    axes[-1].set_yscale("log")  # the p99 has the shared machine's spikes: both stay readable
    axes[-1].set_xticks(x, [f"{r['window']}\n{_op(r)}" for r in rows], fontsize=6)
    fig.suptitle(f"soak: router={router} (red circles: trace A after a flush on the original workers; grey: "
                 f"trace B)", fontsize=10)
    path = out_dir / f"{router}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, default=HERE / "results.json")
    ap.add_argument("--out", type=Path, default=HERE / "plots")
    args = ap.parse_args()
    rows = json.loads(args.results.read_text())["windows"]
    for router in dict.fromkeys(r["router"] for r in rows):
        print(plot_router([r for r in rows if r["router"] == router], args.out))


if __name__ == "__main__":
    main()
