"""experiments/sim_fidelity's reporting: each cell's real and simulated medians over the repeats with their ranges
(`combine`), the error of each figure, and the tables and plot run.py prints and writes: the range table (what item 9
judges), the older targets, the chance a simulator with no bias has at this many repeats, the work audit, the levels
(--host-scale level), the TTFT by turn and each block's throughput. Pure functions of the cells; run.py loads this
file by path."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

FIGURES = (("output_throughput_tok_s", "rel"), ("ttft_p50_ms", "rel"), ("ttft_p99_ms", "rel"),
           ("cache_hit_rate", "abs"))
TARGETS = {"output_throughput_tok_s": 0.10, "ttft_p50_ms": 0.10, "cache_hit_rate": 0.02}
JUDGED = ("output_throughput_tok_s", "ttft_p50_ms", "cache_hit_rate")     # sim median inside the real range
EXTRA = ("sglang_cache_hit_rate_run", "sglang_cache_hit_rate", "total_throughput_tok_s",   # reported, not judged
         "ttft_mean_ms", "engine_ttft_ms_mean")
# the work audit (reported, not judged): the engines' CPU seconds in steps by kind (real: their threads' CPU; sim: the
# cost model's prices of the same kinds of steps), and the HTTP workers' processes' CPU
WORK = ("extend_cpu_s", "decode_cpu_s", "server_process_cpu_s", "requests_completed")
BY_TURN = "ttft_p50_ms_by_turn"   # a multi-turn cell's TTFT p50 per turn (reported, not judged: turn_table)
SPLIT = ("ttft_mean_ms", "engine_ttft_ms_mean")   # the client's mean TTFT and its part in the engines (turn_table)


def errors(case: dict) -> dict:
    out = {}
    for key, kind in FIGURES:
        r, s = case["real"][key], case["sim"][key]
        out[key] = (s - r) / r if kind == "rel" and r else s - r
    return out


def table(cases: list[dict]) -> str:
    head = (f"{'case':<28} {'out tok/s real':>14} {'sim':>8} {'err':>7} {'TTFT p50 ms real':>16} {'sim':>8} "
            f"{'err':>7} {'TTFT p99 err':>12} {'hit real':>8} {'sim':>6} {'abs err':>7} {'bg procs':>8}")
    lines = [head, "-" * len(head)]
    for c in cases:
        r, s, e = c["real"], c["sim"], c["errors"]
        lines.append(f"{c['case']:<28} {r['output_throughput_tok_s']:>14.1f} {s['output_throughput_tok_s']:>8.1f} "
                     f"{e['output_throughput_tok_s']:>+7.1%} {r['ttft_p50_ms']:>16.1f} {s['ttft_p50_ms']:>8.1f} "
                     f"{e['ttft_p50_ms']:>+7.1%} {e['ttft_p99_ms']:>+12.1%} {r['cache_hit_rate']:>8.3f} "
                     f"{s['cache_hit_rate']:>6.3f} {e['cache_hit_rate']:>+7.3f} {c['host_background']:>8.2f}")
    met = {k: sum(abs(c["errors"][k]) <= t for c in cases) for k, t in TARGETS.items()}
    lines.append(f"within target: throughput {met['output_throughput_tok_s']}/{len(cases)} (10%), TTFT p50 "
                 f"{met['ttft_p50_ms']}/{len(cases)} (10%), hit rate {met['cache_hit_rate']}/{len(cases)} (0.02)")
    return "\n".join(lines)


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, label) in zip(axes, (("output_throughput_tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 ms"),
                                       ("cache_hit_rate", "cache hit rate"))):
        shown = [c for c in cases if key != "cache_hit_rate" or c["real"][key] > 0]   # radix cache off: no hits
        for c in shown:
            marker = "o" if c["study"] == "router_ablation" else "s"
            ax.scatter(c["real"][key], c["sim"][key], marker=marker)
            ax.annotate(c["case"], (c["real"][key], c["sim"][key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        values = [c[w][key] for c in shown for w in ("real", "sim")]
        if not values:                                    # (only the TP/DP cells: no hit rate to show)
            ax.set(title=f"{label}: none", xticks=[], yticks=[])
            continue
        lo, hi = min(values) * 0.8, max(values) * 1.2
        if key == "ttft_p50_ms":                          # from tens of ms to seconds
            ax.set(xscale="log", yscale="log")
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="sim = real")
        if key in TARGETS and key != "cache_hit_rate":
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], alpha=0.12, label="+-10%")
        ax.set(xlabel=f"real: {label}", ylabel=f"sim: {label}", title=label, xlim=(lo, hi), ylim=(lo, hi))
        ax.legend(fontsize=7)
    fig.suptitle("mode=sim (calibrated, host_cores=2) vs real runs on this 2-core machine "
                 "(o: router ablation x4, s: TP vs DP attention x2)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread(values: list[float]) -> dict:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "n": len(vals)}


def combine(repeats: list[list[dict]]) -> list[dict]:
    """Each cell over the repeats: real and simulated medians with their ranges, and whether the simulated median
    lies inside the real range (per judged figure). `real`/`sim` hold the medians (the plot and errors read them)."""
    out = []
    for name in dict.fromkeys(c["case"] for rep in repeats for c in rep):
        runs = [c for rep in repeats for c in rep if c["case"] == name]
        keys = [k for k, _ in FIGURES] + list(EXTRA) + list(WORK)
        real = {k: spread([r["real"].get(k) for r in runs]) for k in keys}
        sim = {k: spread([r["sim"].get(k) for r in runs]) for k in keys}
        inside = {k: (real[k]["min"] is not None and sim[k]["median"] is not None
                      and real[k]["min"] <= sim[k]["median"] <= real[k]["max"]) for k in JUDGED}
        below = {k: (None if sim[k]["median"] is None else
                     sum(v < sim[k]["median"] for r in runs if (v := r["real"].get(k)) is not None)) for k in JUDGED}
        bg = [r["host_background"] for r in runs]
        scales = [r.get("host_scale", 1.0) for r in runs]
        steal = [r.get("host_steal") for r in runs]
        out.append({"case": name, "study": runs[0]["study"], "overrides": runs[0]["overrides"], "repeats": len(runs),
                    "real_spread": real, "sim_spread": sim, "inside_real_range": inside, "real_below_sim": below,
                    "host_background": statistics.median(bg), "host_background_range": [min(bg), max(bg)],
                    "host_steal": None if None in steal else statistics.median(steal), "host_scales": scales,
                    "host_levels": [r.get("host_level") for r in runs],
                    "levels_needed": [r.get("level_needed") for r in runs],
                    "ttft_by_turn": {side: _by_turn([r[side].get(BY_TURN) for r in runs]) for side in ("real", "sim")},
                    "real": {k: real[k]["median"] for k in keys}, "sim": {k: sim[k]["median"] for k in keys}})
    return out


def _by_turn(series: list[dict | None]) -> dict[str, float] | None:
    """Per turn (results.json's keys: "0", "1", ...), the median over the runs that report it; None when none does
    (runs before the figure)."""
    runs = [s for s in series if s]
    if not runs:
        return None
    turns = sorted({t for s in runs for t in s}, key=int)
    return {t: statistics.median(s[t] for s in runs if t in s) for t in turns}


def turn_table(cells: list[dict]) -> str:
    """Where a TTFT residual sits (reported, not judged): per cell, the mean TTFT at the client and its part in the
    engines (arrival at the engine to the first token: engine_ttft_ms_mean), real medians over the repeats against
    simulated, and for a multi-turn cell the TTFT p50 by turn. Empty when no real run reports either (runs before
    them)."""
    def split(c):
        return all(c[side].get(k) is not None for side in ("real", "sim") for k in SPLIT)
    rows = [c for c in cells if split(c) or all((c.get("ttft_by_turn") or {}).get(s) for s in ("real", "sim"))]
    if not rows:
        return ""
    lines = ["| cell | TTFT mean ms, client / in the engines: real | sim | TTFT p50 ms by turn, real / sim |",
             "|---|---:|---:|---|"]
    for c in rows:
        sides = [" / ".join(f"{c[side][k]:.0f}" for k in SPLIT) if split(c) else "-" for side in ("real", "sim")]
        turns = c.get("ttft_by_turn") or {}
        real, sim = turns.get("real") or {}, turns.get("sim") or {}
        by_turn = ", ".join(f"{t}: {real[t]:.0f} / {sim[t]:.0f}" for t in real if t in sim) or "-"
        lines.append(f"| {c['case']} | {sides[0]} | {sides[1]} | {by_turn} |")
    return "\n".join(lines)


def range_table(cells: list[dict], load: dict) -> str:
    """Medians with the real repeats' range; `!` flags a simulated median outside it."""
    def cell(c, k, fmt):
        r, s = c["real_spread"][k], c["sim_spread"][k]
        flag = "" if c["inside_real_range"][k] else " !"
        return f"{fmt(r['median'])} [{fmt(r['min'])}-{fmt(r['max'])}] | {fmt(s['median'])}{flag}"
    f1, f3 = (lambda v: f"{v:,.1f}"), (lambda v: f"{v:.3f}")
    lines = ["| cell | n | out tok/s real median [min-max] | sim | TTFT p50 ms real [min-max] | sim | "
             "hit rate real [min-max] | sim | SGLang's hit rate (this run) real / sim | bg procs | host x |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        run = c["real"].get("sglang_cache_hit_rate_run") is not None    # older runs: only since the workers started
        key = "sglang_cache_hit_rate_run" if run else "sglang_cache_hit_rate"
        sr, ss = c["real"].get(key), c["sim"].get(key)
        lines.append(f"| {c['case']} | {c['repeats']} | {cell(c, 'output_throughput_tok_s', f1)} | "
                     f"{cell(c, 'ttft_p50_ms', f1)} | {cell(c, 'cache_hit_rate', f3)} | "
                     f"{'-' if sr is None else f3(sr)}{'' if run else ' (since start)'} / {'-' if ss is None else f3(ss)} | "
                     f"{c['host_background']:.2f}{_steal(c)} | {'/'.join(f'{x:.2f}' for x in c.get('host_scales') or [1.0])} |")
    inside = {k: sum(c["inside_real_range"][k] for c in cells) for k in JUDGED}
    lines.append("")
    lines.append(f"simulated median inside the real range: throughput {inside['output_throughput_tok_s']}/"
                 f"{len(cells)}, TTFT p50 {inside['ttft_p50_ms']}/{len(cells)}, hit rate "
                 f"{inside['cache_hit_rate']}/{len(cells)} (`!`: outside)")
    lines.append(chance_line(cells))
    lines.append(f"host load average (1 min) before / after: {load['before'][0]:.2f} / {load['after'][0]:.2f} on "
                 f"{load['cores']} cores; bg procs: other work's busy processes measured during the real runs "
                 f"(in brackets: of them, the cores' time the hypervisor took, /proc/stat's steal)")
    return "\n".join(lines)


def _steal(cell: dict) -> str:
    return "" if cell.get("host_steal") is None else f" ({cell['host_steal']:.2f})"


def chance_line(cells: list[dict]) -> str:
    """What the range test can say at this many repeats: a simulator with no bias, whose median lies at the real
    runs' own median, falls inside the range of n independent real repeats with probability 1 - 2^(1-n) (outside only
    when all n fall on one side), so every varying figure at once with that to the power of their count (a figure
    equal in every real run, a hit rate of 0, is inside or not by the model alone). And where each simulated median
    fell: how many real repeats lie below it (0 or n: outside)."""
    varying = [(c, k) for c in cells for k in JUDGED if c["real_spread"][k]["min"] != c["real_spread"][k]["max"]]
    ns = [c["real_spread"][k]["n"] for c, k in varying]
    p_all = math.prod(1 - 2.0 ** (1 - n) for n in ns)
    ranks = "; ".join(f"{c['case']} " + "/".join("-" if (b := c["real_below_sim"][k]) is None else str(b)
                                                  for k in JUDGED) for c in cells)
    return (f"a simulator with no bias lands inside each range with probability 1 - 2^(1-n) ({len(varying)} varying "
            f"figures, n = {min(ns, default=0)}-{max(ns, default=0)} repeats: all at once {p_all:.0%}); real repeats "
            f"below the simulated median (throughput/TTFT p50/hit rate): {ranks}")


def level_table(cells: list[dict]) -> str:
    """--host-scale level: each cell's levels over the repeats (its level blocks' reading: medians [min-max]), by
    step kind, how they were read (read_level), and the medians of what its judged runs would have needed read the
    same way (``needed_level``; runs before it: -). Empty without levels."""
    rows = []
    for c in cells:
        levels = [x for x in c.get("host_levels") or [] if x]
        if not levels:
            continue
        needed = [x for x in c.get("levels_needed") or [] if x]
        fmt = {k: spread([x[k] for x in levels]) for k in ("extend", "decode")}
        want = {k: spread([x[k] for x in needed])["median"] for k in ("extend", "decode")}
        outside = [1e3 * x.get("outside_s", x.get("outside_busy_s")) for x in levels
                   if "outside_s" in x or "outside_busy_s" in x]          # (--outside level or load)
        out = spread(outside) if outside else None
        cvs = [x["outside_cv"] for x in levels if "outside_cv" in x]                 # (--outside spread)
        cv = f" (CV {spread(cvs)['median']:.2f} [{min(cvs):.2f}-{max(cvs):.2f}])" if cvs else ""
        rows.append(f"| {c['case']} | {levels[0]['by']} | " + " | ".join(
            f"{f['median']:.3f} [{f['min']:.3f}-{f['max']:.3f}]" for f in fmt.values()) + " | " + " / ".join(
            "-" if v is None else f"{v:.3f}" for v in want.values()) + " | "
            + ("-" if out is None else f"{out['median']:.1f} [{out['min']:.1f}-{out['max']:.1f}]{cv}") + " |")
    if not rows:
        return ""
    return "\n".join(["| cell | level read by | extend level median [min-max] | decode level median [min-max] | "
                      "judged runs needed, extend / decode | outside latency added, ms (--outside level; "
                      "load: with every core busy; spread: its draws' CV) |",
                      "|---|---|---:|---:|---:|---:|", *rows])


def work_table(cells: list[dict]) -> str:
    """Where the time goes, real against simulated (medians over the repeats): the engines' step CPU by kind against
    the prices of the simulated steps of that kind, and the HTTP workers' CPU outside their steps per request (the
    HTTP side of a one-rank worker: its process less its engine thread's steps)."""
    def med(c, side, k):
        return c[f"{side}_spread"][k]["median"]
    lines = ["| cell | extend CPU s real / priced | ratio | decode CPU s real / priced | ratio | "
             "worker CPU outside steps, ms per request |", "|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        row = [c["case"]]
        for k in ("extend_cpu_s", "decode_cpu_s"):
            r, s = med(c, "real", k), med(c, "sim", k)
            row += (["-", "-"] if r is None or s is None else
                    [f"{r:.2f} / {s:.2f}", f"{r / s:.2f}" if s else "-"])
        proc, n = med(c, "real", "server_process_cpu_s"), med(c, "real", "requests_completed")
        steps = [med(c, "real", k) for k in ("extend_cpu_s", "decode_cpu_s")]
        row.append("-" if proc is None or None in steps or not n else f"{(proc - sum(steps)) / n * 1e3:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def block_table(repeats: list[list[dict]]) -> str:
    """Each block's output throughput, real and simulated, with the steal and host speed it was simulated with."""
    rows = ["| repeat | cell | steal (cores) | host x | out tok/s real | sim | error |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for k, cases in enumerate(repeats):
        for c in cases:
            real, sim = c["real"]["output_throughput_tok_s"], c["sim"]["output_throughput_tok_s"]
            steal = "-" if c["host_steal"] is None else f"{c['host_steal']:.3f}"
            rows.append(f"| {k + 1} | {c['case']} | {steal} | {c['host_scale']:.2f} | {real:.1f} | {sim:.1f} | "
                        f"{sim / real - 1:+.1%} |")
    return "\n".join(rows)
