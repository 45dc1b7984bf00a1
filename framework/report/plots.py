"""Matplotlib figures (Agg backend, PNG): one run's (per-worker load over time, expert load heat map), written beside
its results.json by `framework.report.metrics.report`, and a study's over several runs (throughput vs latency over the
request rate, hit rate and TTFT per policy), written by `python -m framework.report`."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_plots(results: dict, out: Path) -> list[Path]:
    """The plots one run's results support (none when they hold no timeline and no expert load)."""
    paths = []
    if results.get("worker_load_timeline"):
        paths.append(worker_load(results["worker_load_timeline"], out / "worker_load.png"))
    load = results.get("expert_load")
    if load and any(sum(v) for v in load.values()):
        paths.append(expert_heatmap(load, out / "expert_load.png"))
    return paths


def worker_load(timeline: dict, path: Path) -> Path:
    """Requests in flight per worker over the run, as the router counted them (its /metrics, sampled)."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for worker, counts in timeline["in_flight"].items():
        ax.step(timeline["t_s"], counts, where="post", label=worker.removeprefix("http://"), linewidth=1.4)
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("requests in flight")
    ax.set_title("Per-worker load (router's /metrics)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def expert_heatmap(expert_load: dict[str, list[int]], path: Path) -> Path:
    """Routed token slots per expert and MoE layer; colour: the expert's share of its layer's slots."""
    layers = sorted(expert_load, key=lambda k: int(k.removeprefix("layer")))
    counts = np.array([expert_load[k] for k in layers], dtype=float)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * counts.shape[1], 1.2 + 0.5 * len(layers)))
    im = ax.imshow(share, cmap="viridis", aspect="auto")
    if counts.shape[1] <= 16:
        for (i, j), n in np.ndenumerate(counts):
            ax.text(j, i, f"{int(n)}", ha="center", va="center", fontsize=7,
                    color="white" if share[i, j] < share.max() * 0.6 else "black")
    ax.set_xticks(range(counts.shape[1]))
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel("expert")
    ax.set_title("Expert load (routed slots; colour = share of the layer)")
    fig.colorbar(im, ax=ax, fraction=0.04)
    return _save(fig, path)


def rate_sweep(series: dict[str, list[dict]], path: Path) -> Path:
    """Left: output throughput against the offered request rate. Right: TTFT p50 / p99 and TPOT p50 against the
    achieved throughput, each point labelled with its rate. One line per series (the other swept settings)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, rows), colour in zip(series.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        rows = sorted(rows, key=lambda r: r["rate"])
        rate = [r["rate"] for r in rows]
        tput = [r["output_throughput_tok_s"] for r in rows]
        left.plot(rate, tput, "o-", color=colour, label=name or "runs")
        for key, style, what in (("ttft_p50_ms", "o-", "TTFT p50"), ("ttft_p99_ms", "s--", "TTFT p99"),
                                 ("tpot_p50_ms", "^:", "TPOT p50")):
            right.plot(tput, [r[key] for r in rows], style, color=colour, label=f"{what} {name}".strip(),
                       alpha=1.0 if key == "ttft_p50_ms" else 0.7)
        for r, x in zip(rows, tput):
            right.annotate(f"{r['rate']:g}/s", (x, r["ttft_p50_ms"]), fontsize=7, textcoords="offset points",
                           xytext=(3, 3))
    left.set(xlabel="offered request rate (req/s)", ylabel="output throughput (tok/s)",
             title="Throughput over the request rate")
    rates = [r["rate"] for rows in series.values() for r in rows]
    if min(rates) > 0 and max(rates) >= 8 * min(rates):     # a doubling sweep: even spacing
        left.set_xscale("log", base=2)
    right.set(xlabel="output throughput (tok/s)", ylabel="latency (ms)", title="Latency against throughput",
              yscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def policy_bars(rows: list[dict], path: Path) -> Path:
    """Cache hit rate and TTFT (p50 bar, p99 tick) per run label (router policy / implementation / workload)."""
    labels = [r["label"] for r in rows]
    x = np.arange(len(rows))
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(rows) + 3), 4.4))
    hit.bar(x, [r["cache_hit_rate"] for r in rows], color="tab:green")
    hit.set(ylabel="cache hit rate (workers' cached / prompt tokens)", ylim=(0, 1), title="Cache hit rate")
    ttft.bar(x, [r["ttft_p50_ms"] for r in rows], color="tab:blue", label="p50")
    ttft.plot(x, [r["ttft_p99_ms"] for r in rows], "_", color="black", markersize=18, mew=2, label="p99")
    ttft.set(ylabel="TTFT (ms)", title="Time to first token")
    ttft.legend(fontsize=8)
    for ax in (hit, ttft):
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


HEATMAP_METRICS = (("cache_hit_rate", "cache hit rate", "{:.3f}", "viridis"),
                   ("ttft_p99_ms", "TTFT p99 (ms)", "{:,.0f}", "viridis_r"),
                   ("output_throughput_tok_s", "output tok/s", "{:,.0f}", "viridis"))


def heatmap(rows: list[dict], x_key: str, y_key: str, path: Path) -> Path:
    """One panel per headline figure (hit rate, TTFT p99, output throughput) over the grid of two swept numeric
    settings, each cell labelled with its value (yellow = best in every panel); a missing point stays blank."""
    xs, ys = sorted({r[x_key] for r in rows}), sorted({r[y_key] for r in rows})
    fig, axes = plt.subplots(1, len(HEATMAP_METRICS), figsize=(1.6 + 1.2 * len(xs) * len(HEATMAP_METRICS),
                                                               1.6 + 0.55 * len(ys)))
    for ax, (key, title, fmt, cmap) in zip(axes, HEATMAP_METRICS):
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in rows:
            grid[ys.index(r[y_key]), xs.index(r[x_key])] = r.get(key, np.nan)
        im = ax.imshow(grid, cmap=cmap, aspect="auto", origin="lower")
        for (i, j), v in np.ndenumerate(grid):
            if v == v:
                r, g, b, _ = im.cmap(im.norm(v))           # dark text on a light cell, light on a dark one
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                        color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")
        ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
        ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
        ax.set(xlabel=x_key, ylabel=y_key, title=title)
        fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)
