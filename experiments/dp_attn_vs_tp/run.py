"""DP attention vs TP for an MLA model when KV memory caps the batch (SGLang PR #1970, scaled down).

For each size, both schemes serve the same decode-heavy workload with the same per-rank KV budget. TP replicates
the single MLA latent on every rank, so its instance holds one rank's worth of tokens; DP attention stores each
token once, so its instance holds `size` times as many and can run a bigger batch. One run prints, side by side:
KV capacity per rank and per instance, peak running requests, output tok/s (decode-dominated), retractions, and
the DP/TP ratios (medians over --repeats). Writes results.json beside this file (or --out).

    python experiments/dp_attn_vs_tp/run.py [--sizes 2 4] [--repeats 3] [--tiny]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from framework.app import run  # noqa: E402
from framework.config import compose  # noqa: E402

KEYS = ("kv_capacity_tokens_per_rank", "kv_capacity_tokens_instance", "max_running_requests",
        "output_throughput_tok_s", "tpot_p50_ms", "retractions", "idle_steps", "graph_eligible_frac", "duration_s")
RATIOS = ("kv_capacity_tokens_instance", "max_running_requests", "output_throughput_tok_s")


def bench(overrides: list[str], out_dir: Path) -> dict:
    cfg = compose(overrides)
    with contextlib.redirect_stdout(io.StringIO()):       # each run's own table; ours comes at the end
        run(cfg, str(out_dir), {"overrides": overrides})
    return json.loads((out_dir / "results.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--tiny", action="store_true", help="a few short requests: the smoke test")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = OmegaConf.to_container(OmegaConf.load(HERE / "config.yaml"))
    overrides = plan["overrides"] + (plan["tiny"]["overrides"] if args.tiny else [])
    sizes = args.sizes or (plan["tiny"]["sizes"] if args.tiny else plan["sizes"])
    repeats = args.repeats or (plan["tiny"]["repeats"] if args.tiny else plan["repeats"])
    schemes: dict[str, list[str]] = plan["schemes"]
    runs, work = [], ROOT / "outputs" / "dp_attn_vs_tp"   # each run's own results.json + config.json
    for rep in range(repeats):            # interleaved, so slow phases of the shared machine hit every config
        for size in sizes:
            for scheme, scheme_overrides in schemes.items():
                t0 = time.perf_counter()
                res = bench(overrides + scheme_overrides + [f"parallel.size={size}"],
                            work / f"{scheme}_x{size}_rep{rep}")
                runs.append({"scheme": scheme, "size": size, "repeat": rep, **{k: res[k] for k in KEYS}})
                print(f"  {scheme:>10} x{size} rep {rep}: {res['output_throughput_tok_s']:8.1f} tok/s, peak "
                      f"{res['max_running_requests']} running ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    summary = summarize(runs, sizes, list(schemes))
    print(table(summary, sizes, list(schemes), repeats))
    args.out.write_text(json.dumps({"overrides": overrides, "schemes": schemes, "sizes": sizes, "repeats": repeats,
                                    "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"results: {args.out}")


def summarize(runs: list[dict], sizes: list[int], schemes: list[str]) -> dict:
    """Flat keys: x{size}_{scheme}_{metric} (median over repeats) and x{size}_{scheme}_over_tp_{metric}."""
    out = {}
    for size in sizes:
        for scheme in schemes:
            mine = [r for r in runs if r["size"] == size and r["scheme"] == scheme]
            for k in KEYS:
                out[f"x{size}_{scheme}_{k}"] = statistics.median(r[k] for r in mine)
        for scheme in schemes[1:]:
            for k in RATIOS:
                out[f"x{size}_{scheme}_over_tp_{k}"] = out[f"x{size}_{scheme}_{k}"] / max(out[f"x{size}_tp_{k}"], 1e-9)
    return out


def table(s: dict, sizes: list[int], schemes: list[str], repeats: int) -> str:
    cols = [("KV tok/rank", "kv_capacity_tokens_per_rank", "{:,.0f}"),
            ("KV tok/instance", "kv_capacity_tokens_instance", "{:,.0f}"),
            ("peak running", "max_running_requests", "{:.0f}"), ("output tok/s", "output_throughput_tok_s", "{:,.1f}"),
            ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"), ("retractions", "retractions", "{:.0f}"),
            ("idle steps", "idle_steps", "{:.0f}"), ("graph-eligible", "graph_eligible_frac", "{:.2f}")]
    head = f"{'size':>4} {'scheme':>12} " + " ".join(f"{c[0]:>15}" for c in cols)
    lines = [f"DP attention vs TP, decode-heavy, same per-rank KV budget (medians of {repeats})", head,
             "-" * len(head)]
    for size in sizes:
        for scheme in schemes:
            lines.append(f"{size:>4} {scheme:>12} " + " ".join(
                f"{fmt.format(s[f'x{size}_{scheme}_{key}']):>15}" for _, key, fmt in cols))
        for scheme in schemes[1:]:
            lines.append(f"{size:>4} {scheme + '/tp':>12} " + " ".join(
                f"{s[f'x{size}_{scheme}_over_tp_{key}']:>14.2f}x" if key in RATIOS else f"{'':>15}"
                for _, key, _ in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
