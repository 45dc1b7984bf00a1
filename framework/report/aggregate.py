"""Compare runs: `python -m framework.report RUN_DIR...`.

Each RUN_DIR is a run directory (results.json + config.json) or anything above some (a multirun's directory, a folder
of runs): every results.json below is one row, and any set of runs compares (two single runs, two multiruns, a mix).
A run is named by its own overrides (Hydra's .hydra/overrides.yaml: `router=round_robin`): the columns are the
overrides that differ between the runs (a run that did not set one shows the value it ran with), then the headline
figures; a failed run keeps its row with its error. Runs that left no overrides (written by an experiment script)
are told apart by the resolved config's differing settings, a group's choice (`router`) standing for the fields it
brings. Written beside the table: summary.md, summary.csv, summary.json, one plot per metric over the runs
(throughput.png, ttft.png, tpot.png, itl.png, e2e.png, cache_hit_rate.png), rate_sweep.png when
`workload.request_rate` varies (throughput and latency over the offered rate, one line per combination of the other
settings) and heatmap.png when exactly two numeric settings vary (hit rate, TTFT p99 and throughput over their grid).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from framework.core.records import RESULTS_FILE
from framework.report import overrides as ov
from framework.report import plots
from framework.report.wandb_log import flatten

TABLE_METRICS = ("requests_completed", "requests_failed", "request_throughput_req_s", "output_throughput_tok_s",
                 "goodput_req_s", "cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
                 "e2e_p50_ms", "e2e_p99_ms", "mean_concurrency", "load_imbalance")
RATE = "workload.request_rate"
W_AND_B_NAME_CHARS = 120


def find_runs(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run directory")
        found += [p] if (p / RESULTS_FILE).is_file() else sorted((r.parent for r in p.rglob(RESULTS_FILE)),
                                                                 key=_natural)
    if not found:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {', '.join(map(str, paths))}")
    return found


def _natural(path: Path) -> list:
    """multirun/2/ before multirun/10/: the points in the order Hydra ran them."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(path)) if t]


def load_run(d: Path) -> dict:
    cfg_file = d / "config.json"
    config = flatten(json.loads(cfg_file.read_text())) if cfg_file.is_file() else {}
    return {"dir": d, "results": json.loads((d / RESULTS_FILE).read_text()), "config": config,
            "overrides": ov.run_overrides(d)}


def _key(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def setting(run: dict, key: str) -> Any:
    """What `key` (an override's key: `router`, `workload.request_rate`) was in this run: its override, else the
    value it ran with (the resolved config; a group by its choice's name), else None."""
    if run["overrides"] and key in run["overrides"]:
        return run["overrides"][key]
    config = run["config"]
    return config[key] if key in config else config.get(f"{key}.name")


def settings_columns(runs: list[dict]) -> list[str]:
    """The settings a reader tells these runs apart by: the overrides that differ (all of them where none does: a
    lone run, repeats), else, with no overrides on record, the resolved config's differing settings (`router` for
    router.name)."""
    asked = [r["overrides"] for r in runs if r["overrides"] is not None]
    if asked:
        keys = list(dict.fromkeys(k for o in asked for k in o))
        differ = [k for k in keys if len({_key(setting(r, k)) for r in runs}) > 1]
        return differ or keys                       # one run, or repeats: what they all ran with
    return [k.removesuffix(".name") for k in config_differences(runs)]


def config_differences(runs: list[dict]) -> list[str]:
    """The config keys that differ, less those a differing group choice explains (`router.name` differs: the router
    fields that follow from the choice are the choice's, not settings of their own)."""
    keys = sorted({k for r in runs for k in r["config"]})
    vary = [k for k in keys if not ov.ignored(k) and len({_key(r["config"].get(k)) for r in runs}) > 1]
    choices = [k.removesuffix(".name") for k in vary if k.endswith(".name")]

    def explained(key: str) -> bool:
        for group in choices:
            if key.startswith(group + "."):
                seen: dict[str, str] = {}
                if all(seen.setdefault(_key(r["config"].get(f"{group}.name")), _key(r["config"].get(key)))
                       == _key(r["config"].get(key)) for r in runs):
                    return True
        return False
    return [k for k in vary if k.endswith(".name") or not explained(k)]


def _distinct_names(dirs: list[Path]) -> list[str]:
    """Each run's path below the runs' common parent: `3` in a multirun, `18-02-11` for runs of one day."""
    resolved = [d.resolve() for d in dirs]
    if len(resolved) == 1:
        return [resolved[0].name]
    common = Path(os.path.commonpath(resolved))
    return [str(d.relative_to(common)) or d.name for d in resolved]


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def rows(runs: list[dict], columns: list[str]) -> list[dict]:
    """One row per run: its settings, `label` (the settings as overrides), its scalar results, `error`, `dir`; and
    `run`, its folder, where the settings leave runs alike (repeats, or no settings at all)."""
    out = []
    for r in runs:
        row: dict[str, Any] = {k: setting(r, k) for k in columns}
        row["label"] = ov.label({k: v for k, v in row.items() if v is not None})
        row.update({k: v for k, v in r["results"].items() if _scalar(v) and k not in row})
        row["error"] = r["results"].get("error", "")
        row["dir"] = str(r["dir"])
        out.append(row)
    labels = [r["label"] for r in out]
    if "" in labels or len(set(labels)) < len(labels):
        for row, name in zip(out, _distinct_names([r["dir"] for r in runs])):
            row["run"] = name
            if not row["label"] or labels.count(row["label"]) > 1:
                row["label"] = f"{row['label']} ({name})" if row["label"] else name
    return out


def _missing(v: Any) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _fmt(v: Any) -> str:
    if _missing(v):
        return ""
    if isinstance(v, float):
        return f"{v:,.4g}"
    return ov.show(v) if isinstance(v, (list, bool)) else str(v)


def table_columns(table: list[dict], settings: list[str]) -> list[str]:
    """The run's folder where settings leave runs alike, the settings, the headline figures, the error: only those
    with a value in some row."""
    wanted = ["run"] + settings + list(TABLE_METRICS) + ["error"]
    if all(r.get("goodput_req_s") == r.get("request_throughput_req_s") for r in table):
        wanted.remove("goodput_req_s")              # no SLO set: goodput is the request throughput
    return [c for c in wanted if any(not _missing(r.get(c)) for r in table)]


def markdown(table: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in table]
    return "\n".join(lines)


def _strict(v: Any) -> Any:
    """NaN and infinities as null: summary.json stays strict JSON."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def aggregate(paths: list[Path], out: Path, draw_plots: bool = True) -> tuple[list[dict], list[Path]]:
    runs = [load_run(d) for d in find_runs(paths)]
    settings = settings_columns(runs)
    table = rows(runs, settings)
    columns = table_columns(table, settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown(table, columns) + "\n")
    (out / "summary.json").write_text(json.dumps([{k: _strict(v) for k, v in r.items()} for r in table], indent=2,
                                                 default=str, allow_nan=False) + "\n")
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns + ["label", "dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: "" if _missing(r.get(k)) else ov.show(r[k]) if isinstance(r[k], (list, bool)) else r[k]
                          for k in columns + ["label", "dir"]} for r in table)          # full precision
    return table, draw(table, settings, out) if draw_plots else []


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def draw(table: list[dict], settings: list[str], out: Path) -> list[Path]:
    ok = [r for r in table if not r["error"]]
    made = plots.compare(ok, out)
    measured = [r for r in ok if not _missing(r.get("ttft_p50_ms"))]
    if RATE in settings and measured and all(_numeric(r[RATE]) for r in measured):
        others = [k for k in settings if k != RATE]
        series: dict[str, list[dict]] = {}
        for r in measured:
            series.setdefault(ov.label({k: r[k] for k in others if r[k] is not None}), []).append(
                {**r, "rate": r[RATE]})
        made.append(plots.rate_sweep(series, out / "rate_sweep.png"))
    if len(settings) == 2 and measured and all(_numeric(r[k]) for r in measured for k in settings):
        made.append(plots.heatmap(measured, settings[0], settings[1], out / "heatmap.png"))
    return made


def wandb_name(table: list[dict]) -> str:
    """The report's W&B run, named by what it compares: the runs' labels (their overrides), shortened to fit."""
    name = "report: " + " | ".join(r["label"] for r in table)
    return name if len(name) <= W_AND_B_NAME_CHARS else name[:W_AND_B_NAME_CHARS - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.report", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, or directories above them (multiruns)")
    ap.add_argument("--out", type=Path, help="where the table and plots go (default: the one directory given, "
                                             "else ./report)")
    ap.add_argument("--wandb", choices=("disabled", "offline", "online"), default="disabled",
                    help="also log the table and plots as one W&B run (job_type=report)")
    ap.add_argument("--no-plots", action="store_true", help="the table only (seconds faster)")
    ap.add_argument("--project", default="servelab")
    ap.add_argument("--name", help="the W&B run's name (default: the compared runs' overrides)")
    args = ap.parse_args(argv)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("report"))
    try:
        table, made = aggregate(args.runs, out, draw_plots=not args.no_plots)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    print(markdown(table, table_columns(table, settings_of(table))))
    print(f"{len(table)} runs; wrote {out / 'summary.md'}, summary.csv, summary.json"
          + (f", {', '.join(p.name for p in made)}" if made else ""))
    if args.wandb != "disabled":
        log_report(table, made, out, args)
    return 0


def settings_of(table: list[dict]) -> list[str]:
    """The settings columns of a table `rows` made: those before `label`."""
    keys = list(table[0])
    return keys[:keys.index("label")]


def log_report(table: list[dict], made: list[Path], out: Path, args) -> None:
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=args.project, mode=args.wandb, dir=str(out), job_type="report",
                     name=args.name or wandb_name(table),
                     group=str(args.runs[0]) if len(args.runs) == 1 else None, reinit="finish_previous")
    columns = sorted({c for r in table for c in r})
    run.log({"summary": wandb.Table(columns=columns, data=[[_fmt(r.get(c)) for c in columns] for r in table]),
             **{f"plots/{p.stem}": wandb.Image(str(p)) for p in made}})
    run.finish()
