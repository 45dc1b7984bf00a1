"""Aggregate runs into one table and its plots: `python -m framework.report RUN_DIR...`.

Each RUN_DIR is a run directory (results.json + config.json) or anything above some (a multirun's directory, a folder
of runs): every results.json below is one row. The columns are the settings that differ between the runs (from each
run's resolved config) and the headline figures; a failed run keeps its row with its error. Written beside the
table: summary.md, summary.csv, summary.json and the plots the runs support: rate_sweep.png when
`workload.request_rate` varies (throughput vs latency over the rate, one line per combination of the other varying
settings), policies.png when a router setting or the workload varies (hit rate and TTFT per run), heatmap.png when
exactly two numeric settings vary (hit rate, TTFT p99 and throughput over their grid: a threshold sweep).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from framework.core.records import RESULTS_FILE
from framework.report import plots
from framework.report.wandb_log import flatten

METRICS = ("requests_completed", "requests_failed", "request_throughput_req_s", "output_throughput_tok_s",
           "goodput_req_s", "cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
           "e2e_p50_ms", "e2e_p99_ms", "mean_concurrency", "load_imbalance")
IGNORED = ("router.port", "cluster.worker_ports", "logger.", "hydra.")   # differ without changing what ran
RATE = "workload.request_rate"


def find_runs(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run directory")
        found += [p] if (p / RESULTS_FILE).is_file() else sorted(r.parent for r in p.rglob(RESULTS_FILE))
    if not found:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {', '.join(map(str, paths))}")
    return found


def load_run(d: Path) -> dict:
    cfg_file = d / "config.json"
    config = flatten(json.loads(cfg_file.read_text())) if cfg_file.is_file() else {}
    return {"dir": d, "results": json.loads((d / RESULTS_FILE).read_text()), "config": config}


def varying(runs: list[dict]) -> list[str]:
    keys = sorted({k for r in runs for k in r["config"]})
    return [k for k in keys if not k.startswith(IGNORED)
            and len({json.dumps(r["config"].get(k), sort_keys=True) for r in runs}) > 1]


def rows(runs: list[dict], vary: list[str]) -> list[dict]:
    out = []
    for r in runs:
        res = r["results"]
        row = {k: r["config"].get(k) for k in vary}
        row.update({m: res[m] for m in METRICS if m in res})
        row["label"] = ", ".join(f"{_short(k)}={r['config'].get(k)}" for k in vary) or r["dir"].name
        row["error"] = res.get("error", "")
        row["dir"] = str(r["dir"])
        out.append(row)
    return out


def _short(key: str) -> str:
    """"router.name" -> "router": a group's chosen option reads as the override that chose it."""
    return key.removesuffix(".name")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.4g}"
    return "" if v is None else str(v)


def markdown(table: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in table]
    return "\n".join(lines)


def aggregate(paths: list[Path], out: Path) -> tuple[list[dict], list[Path]]:
    runs = [load_run(d) for d in find_runs(paths)]
    vary = varying(runs)
    table = rows(runs, vary)
    columns = vary + [m for m in METRICS if any(m in r for r in table)] + (["error"] if any(r["error"] for r in table)
                                                                           else [])
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown(table, columns) + "\n")
    (out / "summary.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns + ["dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    ok = [r for r in table if not r["error"] and "ttft_p50_ms" in r]
    made = []
    if RATE in vary and ok:
        others = [k for k in vary if k != RATE]
        series: dict[str, list[dict]] = {}
        for r in ok:
            name = ", ".join(f"{_short(k)}={r[k]}" for k in others)
            series.setdefault(name, []).append({**r, "rate": r[RATE]})
        made.append(plots.rate_sweep(series, out / "rate_sweep.png"))
    if any(k.startswith(("router.", "workload.name")) for k in vary) and ok and RATE not in vary:
        made.append(plots.policy_bars(ok, out / "policies.png"))
    numeric = [k for k in vary
               if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in ok)]
    if len(vary) == 2 and numeric == vary and ok:
        made.append(plots.heatmap(ok, vary[0], vary[1], out / "heatmap.png"))
    return table, made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.report", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, or directories above them (a multirun)")
    ap.add_argument("--out", type=Path, help="where the table and plots go (default: the one directory given, "
                                             "else ./report)")
    ap.add_argument("--wandb", choices=("disabled", "offline", "online"), default="disabled",
                    help="also log the table and plots as one W&B run (job_type=report)")
    ap.add_argument("--project", default="servelab")
    args = ap.parse_args(argv)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("report"))
    try:
        table, made = aggregate(args.runs, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    columns = [c for c in table[0] if c not in ("dir", "label")]
    print(markdown(table, [c for c in columns if any(r.get(c) not in (None, "") for r in table)]))
    print(f"{len(table)} runs; wrote {out / 'summary.md'}, summary.csv, summary.json"
          + (f", {', '.join(p.name for p in made)}" if made else ""))
    if args.wandb != "disabled":
        _to_wandb(table, made, out, args)
    return 0


def _to_wandb(table: list[dict], made: list[Path], out: Path, args) -> None:
    import wandb
    run = wandb.init(project=args.project, mode=args.wandb, dir=str(out), job_type="report",
                     group=str(args.runs[0]) if len(args.runs) == 1 else None, reinit="finish_previous")
    columns = sorted({c for r in table for c in r})
    run.log({"summary": wandb.Table(columns=columns, data=[[_fmt(r.get(c)) for c in columns] for r in table]),
             **{f"plots/{p.stem}": wandb.Image(str(p)) for p in made}})
    run.finish()
