"""What a `--host-scale level` run's residual is made of, from its stored results and the real runs' own outputs (its
--work folder): per HTTP cell and repeat, the tokens of the level block's draw and the judged draw (another draw of
the same lengths costs the same), the real engines' decode CPU in both, and for one cell the cached tokens per
worker, real and simulated, with the router's own estimate of the hit rate (the same routing or not). Writes JSON.

    python experiments/sim_fidelity/level_diagnostics.py experiments/sim_fidelity/roundM_amd/results.json \
        --work outputs/sim_fidelity --out experiments/sim_fidelity/roundM_amd/diagnostics.json

`--levels bracket` instead re-simulates a run of level blocks before each judged block only (round M's) with each
judged block's level read from its own block pooled with the next repeat's (the nearest block after it, one study
block later for the HTTP cells; the last repeat: its own alone): what reading the level on both sides might buy, on
seen data, before a round that runs a block on each side (sim_fidelity --level-blocks before after). `--levels
needed` simulates each judged block at the level it itself needed (its own engines' step CPU over its simulation's
price): a figure still outside its range then is not the level's error alone; one that moves outside (round M's
multi_turn/cache_aware hit rate) was inside by luck of the level. Both write the range table as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.core.paths import load_script  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402


def trials(fidelity, path: Path) -> dict:
    """A router_ablation results.json's figures by case (sim_fidelity's router_trials)."""
    return {case: t for case, _, t in fidelity.router_trials(path)}


def resimulated(f, stored: dict, args: list[str], how: str) -> dict:
    """Each judged block of a round-M-style run simulated again (sim_fidelity's resimulate, with the stored run's
    switches `args`) at another level: ``bracket``: read from its own level block and the next repeat's, pooled (the
    last repeat: its own alone); ``needed``: the level its judged run itself needed (the level that matches its own
    step CPU). The range table and each case's levels."""
    runs = stored["runs"]

    def bracket(k: int, run: dict) -> dict:
        after = next((r["level_block"] for r in (runs[k + 1] if k + 1 < len(runs) else []) if r["case"] == run["case"]),
                     None)
        return {"before": run["level_block"], "after": after}

    def needed(k: int, run: dict) -> dict:
        c = next(c for c in stored["cases"] if c["case"] == run["case"])
        return {"judged": f.level_block(c["overrides"], run["real"], run)}
    cells, table = f.resimulate(stored, args, lockstep=stored.get("steal") == "lockstep",
                                blocks_of=bracket if how == "bracket" else needed)
    return {"source": stored.get("git_sha"), "levels": how, "sim_args": args,
            "table": table + "\n\n" + f.tables.level_table(cells),
            "cases": [{k: c[k] for k in ("case", "real_spread", "sim_spread", "inside_real_range", "host_levels",
                                         "levels_needed")} for c in cells]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a sim_fidelity run's results.json (--host-scale level)")
    ap.add_argument("--work", type=Path, help="that run's --work folder (its real runs' outputs)")
    ap.add_argument("--levels", choices=["bracket", "needed"],
                    help="instead: re-simulate each judged block at its own and the next repeat's level blocks, "
                         "pooled (bracket), or at the level its judged run itself needed (needed)")
    ap.add_argument("--cell", default="shared_prefix/cache_aware", help="the cell whose workers are compared")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    f = load_script("experiments/sim_fidelity/run.py")
    stored = json.loads(args.results.read_text())
    if args.levels:
        out = resimulated(f, stored, stored["sim_args"], args.levels)
        print(out["table"])
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        return print(f"wrote {args.out}")
    if args.work is None:
        ap.error("--work: the run's real runs' outputs are needed (not with --levels)")
    meta = {c["case"]: c for c in stored["cases"]}
    repeats, workers = [], []
    for k, rep in enumerate(stored["runs"]):
        level = trials(f, args.work / f"repeat{k}" / "level" / "router_ablation" / "results.json")
        judged = trials(f, args.work / f"repeat{k}" / "router_ablation" / "results.json")
        repeats.append({case: {which: {"prompt_tokens": t["bench_serving"]["total_input_tokens"],
                                       "answer_tokens": t["bench_serving"]["total_output_tokens"],
                                       "decode_cpu_s": t["decode_cpu_s"], "extend_cpu_s": t["extend_cpu_s"]}
                               for which, t in (("level_block", level[case]), ("judged", judged[case]))}
                        for case in judged})
        run = next(r for r in rep if r["case"] == args.cell)
        c = meta[args.cell]
        sim, _ = simulate(f.sim_config(c["study"], c["overrides"], stored["sim_args"],
                                       f.block_load(run, stored.get("steal") == "lockstep"),
                                       (run["host_scale"], None, None), run.get("host_level"), draw=k))
        real = judged[args.cell]
        workers.append({"real_cached_tokens": [w["cached_tokens"] for w in real["per_worker"].values()],
                        "sim_cached_tokens": [w["cached_tokens"] for w in sim["per_worker"].values()],
                        "real_router_estimate": real["router_estimated_hit_rate"],
                        "sim_router_estimate": sim["router_estimated_hit_rate"],
                        "real_hit": real["cache_hit_rate"], "sim_hit": sim["cache_hit_rate"],
                        "sim_prompt_tokens": sim["bench_serving"]["total_input_tokens"]})
    args.out.write_text(json.dumps({"source": str(args.results), "cell": args.cell, "repeats": repeats,
                                    "workers": workers}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
