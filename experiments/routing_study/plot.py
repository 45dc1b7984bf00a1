"""One figure per workload: hit rate against the ceiling, the router's estimate beside it, TTFT p50 / p99, and
output throughput, per contender (servelab's policies, then SGLang's router, hatched)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_workload(rows: list[dict], workload: str, ceiling: float, out_dir: Path,
                  title: str = "4 workers (hatched: SGLang's router 0.3.2)") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [r["contender"] for r in rows]
    x = np.arange(len(rows))
    hatch = ["//" if "/" in c else "" for c in labels]
    fig, (hit, ttft, tput) = plt.subplots(1, 3, figsize=(max(13.0, 1.2 * len(rows) * 3), 4.6))
    hit.bar(x - 0.2, [r["cache_hit_rate"] for r in rows], 0.4, color="tab:green", hatch=hatch, label="measured")
    est = [r["router_estimated_hit_rate"] for r in rows]
    hit.bar(x + 0.2, [e if e == e else 0 for e in est], 0.4, color="tab:olive", alpha=0.6, label="router's estimate")
    hit.axhline(ceiling, color="black", ls="--", lw=1, label=f"ceiling {ceiling:.2f}")
    hit.set(ylabel="cache hit rate (cached / prompt tokens)", ylim=(0, 1), title="Hit rate")
    ttft.bar(x, [r["ttft_p50_ms"] for r in rows], color="tab:blue", hatch=hatch, label="p50")
    ttft.plot(x, [r["ttft_p99_ms"] for r in rows], "_", color="black", markersize=16, mew=2, label="p99")
    ttft.set(ylabel="TTFT (ms)", title="Time to first token")
    tput.bar(x, [r["output_throughput_tok_s"] for r in rows], color="tab:orange", hatch=hatch)
    tput.set(ylabel="output tokens / s", title="Throughput")
    for ax in (hit, ttft, tput):
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    hit.legend(fontsize=7, loc="upper left")
    ttft.legend(fontsize=7)
    fig.suptitle(f"{workload}: {title}", fontsize=11)
    fig.tight_layout()
    path = out_dir / f"{workload}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
