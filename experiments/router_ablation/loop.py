"""The cluster loop the router experiments share (router_ablation, pd_side_by_side, pd_study's real half): one set of
workers serves every run, each run starts its own router process after every worker's prefix cache is flushed, the
repeats are interleaved so the machine's noise spreads over every cell, and each cell's row is the median of its
repeats. Router CPU per request is the router process's CPU time over the run (servelab: its /router_stats; SGLang:
/proc) divided by the requests.

    from loop import Cell, median_run, run_cells, table, with_workers   # (this folder on sys.path)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from framework.cluster.cluster import Cluster
from framework.cluster.figures import bench
from framework.core.registry import WORKLOAD


@dataclass
class Cell:
    router: Any                         # the router's config (a composed cfg.router)
    run: Any                            # the run's config: its workload is what the load client plays
    labels: dict = field(default_factory=dict)   # what names the cell in its rows (workload, router, impl, ...)


def with_workers(cfg, fn: Callable[[Cluster], Any]) -> Any:
    """Start `cfg`'s workers (warmed up), call fn(cluster), stop them whatever happens."""
    cluster = Cluster(cfg)
    try:
        cluster.start_workers()
        cluster.warm_up()
        return fn(cluster)
    finally:
        cluster.stop()


def run_cells(cluster: Cluster, cells: dict[Hashable, Cell], repeats: int = 1,
              extra: Callable[[dict, list], dict] | None = None) -> dict[Hashable, list[dict]]:
    """Every cell `repeats` times, interleaved; each trial is the run's results plus the cell's labels, `repeat`,
    `router_cpu_us_per_req` and `extra(results, records)`. Prints a line per trial."""
    trials: dict[Hashable, list[dict]] = {k: [] for k in cells}
    for rep in range(repeats):
        for key, cell in cells.items():
            cluster.start_router(cell.router)
            cluster.flush_caches()
            cfg = cell.run
            sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
            cpu0 = cluster.router_stats()["process_cpu_s"]
            results, records = bench(cluster, cfg, sessions)
            cpu = cluster.router_stats()["process_cpu_s"] - cpu0
            results.pop("worker_load_timeline", None)
            done = max(results["requests_completed"], 1)
            trials[key].append({**results, **cell.labels, "repeat": rep, "router_cpu_us_per_req": cpu / done * 1e6,
                                **(extra(results, records) if extra else {})})
            print(f"  {' '.join(str(v) for v in cell.labels.values()):<36} goodput {results['goodput_req_s']:6.2f} "
                  f"req/s  hit {results['cache_hit_rate']:.3f}  TTFT p50 {results['ttft_p50_ms']:6.0f} ms  "
                  f"{results['output_throughput_tok_s']:7.1f} out tok/s  {results['duration_s']:5.1f} s", flush=True)
    return trials


def median_run(trials: list[dict]) -> dict:
    """One row per cell: the median of every number over its repeats (failures summed; the first trial's other
    fields)."""
    row = dict(trials[0])
    for k, v in row.items():
        if k == "requests_failed":
            row[k] = sum(t[k] for t in trials)         # failures of every repeat count
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "repeat":
            row[k] = statistics.median(t[k] for t in trials)
    row.pop("repeat", None)
    return row


def table(cols: list[tuple[str, str, str]], runs: list[dict], text_cols: int = 1) -> str:
    """A plain-text table: `cols` are (header, key, format); the first `text_cols` columns are left-aligned."""
    rows = [[c[0] for c in cols]] + [[fmt.format(r[k]) for _, k, fmt in cols] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [" | ".join(v.ljust(w) if i < text_cols else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])
