"""DP attention vs TP for an MLA model when KV memory caps the batch (SGLang PR #1970, scaled down).

For each memory sizing and size, every scheme serves the same decode-heavy workload. `kv_budget`: the same KV bytes
per rank for every scheme (TP replicates the one MLA latent on every rank, so its instance holds one rank's worth of
tokens; DP attention stores each token once, so its instance holds `size` times as many). `mem_budget`: SGLang's
sizing, the same memory per rank for weights + KV, so DP attention, which keeps attention, embedding and lm_head
whole on every rank, has less KV per rank than TP. One run prints, side by side: weights and KV capacity per rank,
KV per instance, peak running requests, output tok/s (decode-dominated), retractions, and the ratios to TP (medians
over --repeats). Writes results.json beside this file (or --out).

    python experiments/dp_attn_vs_tp/run.py [--sizes 2 4] [--repeats 3] [--sizings kv_budget mem_budget] [--tiny]
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

KEYS = ("weight_bytes_per_rank", "kv_capacity_tokens_per_rank", "kv_capacity_tokens_instance", "max_running_requests",
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
    ap.add_argument("--sizings", nargs="+")
    ap.add_argument("--tiny", action="store_true", help="a few short requests: the smoke test")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "dp_attn_vs_tp",
                    help="where each run writes its own results.json + config.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = OmegaConf.to_container(OmegaConf.load(HERE / "config.yaml"))
    tiny = plan["tiny"] if args.tiny else {}
    overrides = plan["overrides"] + tiny.get("overrides", [])
    sizes = args.sizes or tiny.get("sizes") or plan["sizes"]
    repeats = args.repeats or tiny.get("repeats") or plan["repeats"]
    schemes = {k: v for k, v in plan["schemes"].items() if k in tiny.get("schemes", plan["schemes"])}
    sizings = {k: v for k, v in plan["sizings"].items() if k in (args.sizings or plan["sizings"])}
    runs, work = [], args.work
    for rep in range(repeats):            # interleaved, so slow phases of the shared machine hit every config
        for sizing, sizing_overrides in sizings.items():
            for size in sizes:
                for scheme, scheme_overrides in schemes.items():
                    t0 = time.perf_counter()
                    res = bench(overrides + sizing_overrides + scheme_overrides + [f"parallel.size={size}"],
                                work / f"{sizing}_{scheme}_x{size}_rep{rep}")
                    runs.append({"sizing": sizing, "scheme": scheme, "size": size, "repeat": rep,
                                 **{k: res[k] for k in KEYS}, "kv_sizing": res["kv_sizing"]})
                    print(f"  {sizing:>10} {scheme:>10} x{size} rep {rep}: {res['output_throughput_tok_s']:8.1f} "
                          f"tok/s, peak {res['max_running_requests']} running ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr)
    summary = summarize(runs, sizings, sizes, list(schemes))
    print(table(summary, sizings, sizes, list(schemes), repeats))
    args.out.write_text(json.dumps({"overrides": overrides, "schemes": schemes, "sizings": sizings, "sizes": sizes,
                                    "repeats": repeats, "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"results: {args.out}")


def summarize(runs: list[dict], sizings: dict, sizes: list[int], schemes: list[str]) -> dict:
    """Flat keys: {sizing}_x{size}_{scheme}_{metric} (median over repeats) and {sizing}_x{size}_{scheme}_over_tp_
    {metric}."""
    out = {}
    for sizing in sizings:
        for size in sizes:
            head = f"{sizing}_x{size}"
            for scheme in schemes:
                mine = [r for r in runs if (r["sizing"], r["size"], r["scheme"]) == (sizing, size, scheme)]
                for k in KEYS:
                    out[f"{head}_{scheme}_{k}"] = statistics.median(r[k] for r in mine)
            for scheme in schemes[1:]:
                for k in RATIOS:
                    out[f"{head}_{scheme}_over_tp_{k}"] = out[f"{head}_{scheme}_{k}"] / max(out[f"{head}_tp_{k}"], 1e-9)
    return out


def table(s: dict, sizings: dict, sizes: list[int], schemes: list[str], repeats: int) -> str:
    cols = [("weights MB/rank", "weight_bytes_per_rank", lambda v: f"{v / 2**20:.3f}"),
            ("KV tok/rank", "kv_capacity_tokens_per_rank", "{:,.0f}".format),
            ("KV tok/instance", "kv_capacity_tokens_instance", "{:,.0f}".format),
            ("peak running", "max_running_requests", "{:.0f}".format),
            ("output tok/s", "output_throughput_tok_s", "{:,.1f}".format),
            ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}".format), ("retractions", "retractions", "{:.0f}".format),
            ("idle steps", "idle_steps", "{:.0f}".format), ("graph-eligible", "graph_eligible_frac", "{:.2f}".format)]
    head = f"{'sizing':>10} {'size':>4} {'scheme':>14} " + " ".join(f"{c[0]:>15}" for c in cols)
    lines = [f"DP attention vs TP, decode-heavy, moe=triton_fused (medians of {repeats})", head, "-" * len(head)]
    for sizing in sizings:
        for size in sizes:
            key = f"{sizing}_x{size}"
            for scheme in schemes:
                lines.append(f"{sizing:>10} {size:>4} {scheme:>14} " + " ".join(
                    f"{fmt(s[f'{key}_{scheme}_{k}']):>15}" for _, k, fmt in cols))
            for scheme in schemes[1:]:
                lines.append(f"{sizing:>10} {size:>4} {scheme + '/tp':>14} " + " ".join(
                    f"{s[f'{key}_{scheme}_over_tp_{k}']:>14.2f}x" if k in RATIOS else f"{'':>15}" for _, k, _ in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
