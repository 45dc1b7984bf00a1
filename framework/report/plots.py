"""Matplotlib figures (Agg backend, PNG): one run's (per-worker load over time, expert load heat map), written beside
its results.json by `framework.report.metrics.report`, and those over several runs written by
`python -m framework.report`: one per metric (each run a bar, named by its overrides), throughput and latency over
the request rate, a heat map over two swept settings.

Every figure is readable on a screen: constrained layout (labels never clipped, no "tight layout" warnings), at most
three panels a row, at most MAX_WIDTH_IN wide, legends outside the axes so they never cover data.
tests/report/test_plots_fit.py renders each one and checks that its labels fit."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

DPI = 110
MAX_WIDTH_IN = 17.5          # 1,925 px at DPI
MAX_HEIGHT_IN = 24.0
COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def figure(width_in: float, height_in: float, nrows: int = 1, ncols: int = 1, **kw):
    """A constrained-layout figure within the size bounds; `squeeze=False` axes when asked through kw."""
    size = (min(width_in, MAX_WIDTH_IN), min(height_in, MAX_HEIGHT_IN))
    return plt.subplots(nrows, ncols, figsize=size, layout="constrained", **kw)


def save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v) -> str:
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def thousands(axis) -> None:
    """At most six ticks, written 20,000: wide numbers never run into each other."""
    axis.set_major_locator(MaxNLocator(6))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))


def plain_log_labels(ax) -> None:
    """Log axes labelled 4, 8, 30 rather than 2^2, 2^3, 3x10^1."""
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":
            axis.set_major_formatter(plain)
            lo, hi = sorted(axis.get_view_interval())
            axis.set_minor_formatter(plain if lo > 0 and hi / lo < 30 else NullFormatter())   # few decades: 20, 30


# ---------------------------------------------------------------- one run


def run_plots(results: dict, out: Path) -> list[Path]:
    """The plots one run's results support (none when they hold no timeline and no expert load)."""
    paths = []
    if results.get("worker_load_timeline"):
        paths.append(worker_load(results["worker_load_timeline"], out / "worker_load.png"))
    load = results.get("expert_load")
    if load and any(sum(v) for v in load.values()):
        paths.append(expert_heatmap(load, out / "expert_load.png"))
    return paths


MAX_WORKER_LINES = 8


def worker_load(timeline: dict, path: Path) -> Path:
    """Requests in flight per worker over the run, as the router counted them (its /metrics, sampled); beyond
    MAX_WORKER_LINES workers, their spread (min-max band) and mean instead of one line each."""
    fig, ax = figure(9.0, 3.8)
    t = timeline["t_s"]
    counts = timeline["in_flight"]
    if len(counts) <= MAX_WORKER_LINES:
        for worker, series in counts.items():
            ax.step(t, series, where="post", label=worker.removeprefix("http://"), linewidth=1.4)
    else:
        grid = np.array(list(counts.values()), dtype=float)
        ax.fill_between(t, grid.min(axis=0), grid.max(axis=0), step="post", alpha=0.3,
                        label=f"min-max over {len(counts)} workers")
        ax.step(t, grid.mean(axis=0), where="post", color="black", linewidth=1.2, label="mean")
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("requests in flight")
    ax.set_title("Per-worker load (router's /metrics)")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
    return save(fig, path)


def _spread(n: int, most: int) -> list[int]:
    """Up to `most` tick positions over 0..n-1, evenly spread (all of them when they fit)."""
    return list(range(n)) if n <= most else sorted({int(round(i)) for i in np.linspace(0, n - 1, most)})


def expert_heatmap(expert_load: dict[str, list[int]], path: Path) -> Path:
    """Routed token slots per expert and MoE layer; colour: the expert's share of its layer's slots (counts written in
    the cells when they fit)."""
    layers = sorted(expert_load, key=lambda k: int(k.removeprefix("layer")))
    counts = np.array([expert_load[k] for k in layers], dtype=float)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    experts = counts.shape[1]
    fig, ax = figure(2.6 + 0.55 * min(experts, 24), 1.6 + 0.45 * min(len(layers), 16))   # past that, cells shrink
    im = ax.imshow(share, cmap="viridis", aspect="auto")
    if experts <= 16 and len(layers) <= 32:
        for (i, j), n in np.ndenumerate(counts):
            ax.text(j, i, f"{int(n)}", ha="center", va="center", fontsize=7,
                    color="white" if share[i, j] < share.max() * 0.6 else "black")
    xs = _spread(experts, 32)
    ax.set_xticks(xs, [str(j) for j in xs])
    ys = _spread(len(layers), 24)
    ax.set_yticks(ys, [layers[i] for i in ys])
    ax.set_xlabel("expert")
    ax.set_title("Expert load (routed slots; colour = share of the layer)")
    fig.colorbar(im, ax=ax, fraction=0.04)
    return save(fig, path)


# ---------------------------------------------------------------- several runs

@dataclass(frozen=True)
class Metric:
    """One comparison plot: `stem`.png, one bar per (results key, series name) and run."""
    stem: str
    title: str
    axis: str
    series: tuple[tuple[str, str], ...]
    limits: tuple[float, float] | None = None
    needs_every_series: bool = False        # request throughput alone repeats the throughput plot: goodput makes it


PERCENTILES = (("p50", "p50"), ("p90", "p90"), ("p99", "p99"))
COMPARE = (
    Metric("throughput", "Output throughput", "output tokens / s", (("output_throughput_tok_s", "output"),)),
    Metric("requests", "Request throughput and goodput", "requests / s",
           (("request_throughput_req_s", "completed"), ("goodput_req_s", "goodput (within every SLO)")),
           needs_every_series=True),
    *(Metric(stem, title, f"{stem.upper()} (ms)", tuple((f"{stem}_{p}_ms", name) for p, name in PERCENTILES))
      for stem, title in (("ttft", "Time to first token"), ("tpot", "Time per output token"),
                          ("itl", "Inter-token latency"), ("e2e", "End-to-end latency"))),
    Metric("cache_hit_rate", "Cache hit rate", "cached / prompt tokens",
           (("cache_hit_rate", "measured (workers)"), ("router_estimated_hit_rate", "router's estimate")), (0.0, 1.0)),
)


def compare(rows: list[dict], out: Path) -> list[Path]:
    """One plot per metric over the runs (each row a run with its `label`): those some run measured. A series no run
    measured, or one equal to the first everywhere (goodput without an SLO), is left out."""
    made = []
    for m in COMPARE:
        first = [r.get(m.series[0][0]) for r in rows]
        kept = [(k, name) for i, (k, name) in enumerate(m.series)
                if any(_finite(r.get(k)) for r in rows) and (i == 0 or [r.get(k) for r in rows] != first)]
        if kept and kept[0] == m.series[0] and (len(kept) == len(m.series) or not m.needs_every_series):
            made.append(metric_bars(rows, m.title, m.axis, kept, out / f"{m.stem}.png", m.limits))
    return made


def metric_bars(rows: list[dict], title: str, axis: str, series: list[tuple[str, str]], path: Path,
                limits: tuple[float, float] | None = None) -> Path:
    """Horizontal bars, one group per run (top to bottom in the table's order, named by the run's label on the
    left, where a long name has room), one bar per series, each with its value."""
    labels = [r["label"] for r in rows]
    n, k = len(rows), len(series)
    row_in = max(0.3, 0.21 * k)
    width = 5.5 + 0.062 * max(len(s) for s in labels)
    fig, ax = figure(width, 1.3 + (0.35 if k > 1 else 0) + n * row_in)
    y = np.arange(n)
    h = 0.8 / k
    top = 0.0
    for j, ((key, name), colour) in enumerate(zip(series, COLOURS)):
        values = [r.get(key) if _finite(r.get(key)) else np.nan for r in rows]
        bars = ax.barh(y - 0.4 + h * (j + 0.5), values, h, color=colour, label=name)
        ax.bar_label(bars, labels=[_num(v) if v == v else "" for v in values], fontsize=7, padding=2)
        top = max([top] + [v for v in values if v == v])
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    lo, hi = limits if limits else (0.0, top or 1.0)
    ax.set_xlim(lo, max(hi, top) * 1.18)            # room for the value written after the longest bar
    ax.set(xlabel=axis, title=title)
    thousands(ax.xaxis)
    ax.grid(axis="x", alpha=0.3)
    if k > 1:
        fig.legend(loc="outside lower center", ncols=k, fontsize=8)
    return save(fig, path)


def rate_sweep(series: dict[str, list[dict]], path: Path) -> Path:
    """Output throughput, TTFT and TPOT (p50 solid, p99 dashed) over the offered request rate: one colour per
    series (a combination of the other swept settings), the legend below the panels."""
    fig, (tput, ttft, tpot) = figure(15.0, 4.9, 1, 3)
    for (name, rows), colour in zip(series.items(), COLOURS * 4):
        rows = sorted(rows, key=lambda r: r["rate"])
        rate = [r["rate"] for r in rows]
        tput.plot(rate, [r.get("output_throughput_tok_s", np.nan) for r in rows], "o-", color=colour)
        for ax, metric in ((ttft, "ttft"), (tpot, "tpot")):
            ax.plot(rate, [r.get(f"{metric}_p50_ms", np.nan) for r in rows], "o-", color=colour)
            ax.plot(rate, [r.get(f"{metric}_p99_ms", np.nan) for r in rows], "s--", color=colour, alpha=0.7)
    rates = [r["rate"] for rows in series.values() for r in rows]
    doubling = min(rates) > 0 and max(rates) >= 8 * min(rates)      # a doubling sweep: even spacing
    for ax, ylabel, title in ((tput, "output tokens / s", "Throughput"), (ttft, "TTFT (ms)", "Time to first token"),
                              (tpot, "TPOT (ms)", "Time per output token")):
        ax.set(xlabel="offered request rate (req/s)", ylabel=ylabel, title=title)
        if doubling:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    for ax in (ttft, tpot):
        ax.set_yscale("log")
    thousands(tput.yaxis)
    for ax in (tput, ttft, tpot):
        plain_log_labels(ax)
    handles = [Line2D([], [], color="black", marker="o", label="p50"),
               Line2D([], [], color="black", marker="s", ls="--", label="p99")]
    if len(series) > 1 or next(iter(series)):
        handles = [Line2D([], [], color=c, lw=3, label=name or "the rest")
                   for name, c in zip(series, COLOURS * 4)] + handles
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=8)
    return save(fig, path)


HEATMAP_METRICS = (("cache_hit_rate", "cache hit rate", "{:.3f}", "viridis"),
                   ("ttft_p99_ms", "TTFT p99 (ms)", "{:,.0f}", "viridis_r"),
                   ("output_throughput_tok_s", "output tok/s", "{:,.0f}", "viridis"))


def heatmap(rows: list[dict], x_key: str, y_key: str, path: Path) -> Path:
    """One panel per headline figure (hit rate, TTFT p99, output throughput) over the grid of two swept numeric
    settings, each cell labelled with its value (yellow = best in every panel); a missing point stays blank. Side
    by side while three panels fit the width, else one above the other."""
    xs, ys = sorted({r[x_key] for r in rows}), sorted({r[y_key] for r in rows})
    panel_w, panel_h = 2.4 + 0.75 * len(xs), 1.8 + 0.4 * len(ys)
    across = 3 * panel_w <= MAX_WIDTH_IN
    n = len(HEATMAP_METRICS)
    fig, axes = figure(panel_w * (n if across else 1), panel_h * (1 if across else n), 1 if across else n,
                       n if across else 1)
    for ax, (key, title, fmt, cmap) in zip(axes, HEATMAP_METRICS):
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in rows:
            if _finite(r.get(key)):
                grid[ys.index(r[y_key]), xs.index(r[x_key])] = r[key]
        im = ax.imshow(grid, cmap=cmap, aspect="auto", origin="lower")
        for (i, j), v in np.ndenumerate(grid):
            if v == v:
                r, g, b, _ = im.cmap(im.norm(v))           # dark text on a light cell, light on a dark one
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                        color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")
        ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs], fontsize=8)
        ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys], fontsize=8)
        ax.set(xlabel=x_key, ylabel=y_key, title=title)
        fig.colorbar(im, ax=ax, fraction=0.046)
    return save(fig, path)
