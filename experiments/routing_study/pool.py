"""Pool the repeats of several real-cluster routing-study runs and compare two contenders with the noise in view.

On the shared 2-core CPU one cell is 5-20 s of traffic, and the same router's hit rate moves by 0.05-0.1 between
repeats (the balance rule and the queues follow CPU scheduling), more than routers differ. Pooling runs of the same
policy code gives enough repeats to say which differences are more than that noise: per workload and metric, each
contender's median, the share of (a, b) repeat pairs in which ``a`` is the better (0.5: no difference; a
common-language effect size) and a two-sided permutation test of the difference in medians.

    python experiments/routing_study/pool.py experiments/routing_study/real_sticky/results.json other/results.json \
        [--a sticky_prefix] [--b cache_aware/sglang] [--out experiments/routing_study/real_sticky/pooled.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

# metric -> (results key, True when higher is better)
METRICS = {"hit": ("cache_hit_rate", True), "TTFT p99 ms": ("ttft_p99_ms", False),
           "out tok/s": ("output_throughput_tok_s", True)}


def permutation_p(a: list[float], b: list[float], shuffles: int = 20000, seed: int = 0) -> float:
    """Two-sided p of |median(a) - median(b)| under exchangeable labels (a seeded Monte-Carlo permutation test)."""
    observed = abs(statistics.median(a) - statistics.median(b))
    pooled, rng, hits = a + b, random.Random(seed), 0
    for _ in range(shuffles):
        rng.shuffle(pooled)
        if abs(statistics.median(pooled[:len(a)]) - statistics.median(pooled[len(a):])) >= observed - 1e-12:
            hits += 1
    return (hits + 1) / (shuffles + 1)


def better_share(a: list[float], b: list[float], higher: bool) -> float:
    """The share of (x in a, y in b) pairs where x is the better (ties count half)."""
    wins = sum((x > y if higher else x < y) + 0.5 * (x == y) for x in a for y in b)
    return wins / (len(a) * len(b))


def compare(trials: list[dict], a: str, b: str) -> list[dict]:
    rows = []
    for w in dict.fromkeys(t["workload"] for t in trials):
        runs = {c: [t for t in trials if t["workload"] == w and t["contender"] == c] for c in (a, b)}
        if not all(runs.values()):
            continue
        row = {"workload": w, "repeats": {c: len(r) for c, r in runs.items()}}
        for name, (key, higher) in METRICS.items():
            xa, xb = [t[key] for t in runs[a]], [t[key] for t in runs[b]]
            row[name] = {"a": statistics.median(xa), "b": statistics.median(xb),
                         "a_better_share": better_share(xa, xb, higher), "p": permutation_p(xa, xb)}
        errors = [t["router_estimated_hit_rate"] - t["cache_hit_rate"] for t in runs[a]]
        row["a_estimate_error"] = {"median": statistics.median(errors), "min": min(errors), "max": max(errors)}
        rows.append(row)
    return rows


def markdown(rows: list[dict], a: str, b: str) -> str:
    out = [f"| workload (repeats {a} / {b}) | " + " | ".join(f"{m}: {a} / {b}, P({a} better), p" for m in METRICS)
           + f" | {a} est. - hit: median (range) |", "|---|" + "---|" * (len(METRICS) + 1)]
    for r in rows:
        cells = []
        for m, (_, _) in METRICS.items():
            c, fmt = r[m], "{:.3f}" if m == "hit" else "{:.0f}" if "ms" in m else "{:.1f}"
            cells.append(f"{fmt.format(c['a'])} / {fmt.format(c['b'])}, {c['a_better_share']:.2f}, {c['p']:.3f}")
        e = r["a_estimate_error"]
        cells.append(f"{e['median']:+.3f} ({e['min']:+.3f} to {e['max']:+.3f})")
        out.append(f"| {r['workload']} ({r['repeats'][a]} / {r['repeats'][b]}) | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="results.json files of real-cluster runs (--mode real)")
    ap.add_argument("--a", default="sticky_prefix")
    ap.add_argument("--b", default="cache_aware/sglang")
    ap.add_argument("--out", type=Path, default=None, help="write the pooled comparison here (json; .md beside it)")
    args = ap.parse_args()
    trials, sources = [], []
    for path in args.results:
        run = json.loads(path.read_text())
        if run.get("mode") != "real":
            raise SystemExit(f"{path}: mode is {run.get('mode')!r}; pool real-cluster runs (simulated seeds are "
                             "deterministic: compare them with run.py --mode sim --repeats N)")
        trials += run["trials"]
        sources.append({"path": str(path), "git_sha": run["git_sha"], "repeats": run["repeats"]})
    rows = compare(trials, args.a, args.b)
    if not rows:
        raise SystemExit(f"no workload has trials of both {args.a!r} and {args.b!r} in {[str(p) for p in args.results]}")
    text = markdown(rows, args.a, args.b)
    print(text, end="")
    if args.out:
        args.out.write_text(json.dumps({"a": args.a, "b": args.b, "sources": sources, "rows": rows}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
