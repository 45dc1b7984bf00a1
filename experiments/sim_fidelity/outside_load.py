"""How a request's time outside the engines grows with the load, real against simulated (issue 19, item 9: round P's
term, `sim.outside_busy_s`).

Runs experiments/router_ablation for real at several client concurrencies (servelab's router and 4 one-rank HTTP
workers, round robin: sim_fidelity's HTTP cells with `workload.max_concurrency` changed) and reads each run's time
outside the engines per request (client, router, HTTP hand-off: `ttft_mean_ms - engine_ttft_ms_mean`). Each run is
then simulated at its own level (sim_fidelity's read_level, the run as its own level block: the engines' speed is
not what is checked) three ways: the router's constant alone, plus sim_fidelity's `--outside level` constant read
at --read-at's run, or plus its `--outside load` wait read there (`sim.outside_busy_s`, scaled by the cores' busy
share at each send). The check: which of the two follows the real time to the other concurrencies.

    python experiments/sim_fidelity/outside_load.py        # concurrency 1, 4 and 16, read at 16 (~3 min)

Prints the table and writes results.json and table.md to --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.core.paths import git_sha, load_script  # noqa: E402
from framework.runs.finish import json_safe  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

SF = load_script("experiments/sim_fidelity/run.py")
# the simulator's switches: round P's (protocol_round_p.md), less --outside, which this script sets per column (kept
# by hand: a later round's switches are not this script's until it says so)
ROUND_FLAGS = ["--host-scale", "level", "--contention", "none", "--steal", "lockstep", "--prefix-regime", "absorbed",
               "--extend", "per_request", "--batch-arrivals", "--profile", "data/calibration/cpu_amd_epyc_l.json"]
WAYS = ("none", "level", "load")            # the columns: sim_fidelity's --outside


def real_run(concurrency: int, workloads: list[str], work: Path) -> list[tuple[str, list[str], dict, dict]]:
    """One run of router_ablation at this concurrency: (case, overrides, figures, the other work during it)."""
    out = work / f"concurrency{concurrency}"
    cmd = [sys.executable, str(ROOT / "experiments/router_ablation/run.py"), "--impls", "servelab", "--policies",
           "round_robin", "--workloads", *workloads, "--out", str(out),
           "--overrides", f"workload.max_concurrency={concurrency}"]
    with SF.Background() as background:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    measured = {"host_background": background.procs, "host_steal": background.steal}
    return [(case, overrides, real, measured)
            for case, overrides, real in SF.router_trials(out / "results.json")]


def gap_ms(figures: dict) -> float:
    return figures["ttft_mean_ms"] - figures["engine_ttft_ms_mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--read-at", type=int, default=16, help="the concurrency whose run the outside terms are read at")
    ap.add_argument("--workloads", nargs="+", default=["shared_prefix", "multi_turn"])
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "outside_load")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "outside_load")
    args = ap.parse_args()
    if args.read_at not in args.concurrency:
        sys.exit(f"--read-at {args.read_at}: not one of --concurrency {args.concurrency}")
    flags = SF.parser().parse_args(ROUND_FLAGS)
    sim_args = SF.SIM + SF.switches(flags) + ["sim.answers=measured"]
    lockstep = flags.steal == "lockstep"
    t0 = time.time()
    runs = {c: real_run(c, args.workloads, args.work) for c in args.concurrency}
    print(f"real runs done ({time.time() - t0:.0f} s)", flush=True)
    blocks = {c: {case: (overrides, SF.block_load(measured, lockstep), real)
                  for case, overrides, real, measured in trials} for c, trials in runs.items()}
    rows = []
    for case in blocks[args.read_at]:
        read = {way: SF.read_level(case, "router_ablation", sim_args, [blocks[args.read_at][case]], outside=way)
                for way in ("level", "load")}
        for c in args.concurrency:
            overrides, load, real = blocks[c][case]
            own = SF.read_level(case, "router_ablation", sim_args, [blocks[c][case]])     # this run's engines' speed
            levels = {"none": own, "level": {**own, "outside_s": read["level"]["outside_s"]},
                      "load": {**own, "outside_busy_s": read["load"]["outside_busy_s"]}}
            sims = {way: simulate(SF.sim_config("router_ablation", overrides, sim_args, load, level=levels[way]))[0]
                    for way in WAYS}
            rows.append({"case": case, "concurrency": c, "real_gap_ms": gap_ms(real),
                         "real_ttft_mean_ms": real["ttft_mean_ms"],
                         **{f"sim_{way}_gap_ms": gap_ms(s) for way, s in sims.items()},
                         **{f"sim_{way}_ttft_mean_ms": s["ttft_mean_ms"] for way, s in sims.items()},
                         "sim_load_busy_share": sims["load"]["sim_send_busy_share"],
                         "outside_s_read": read["level"]["outside_s"],
                         "outside_busy_s_read": read["load"]["outside_busy_s"]})
    text = table(rows, args.read_at)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(json_safe(
        {"experiment": "sim_fidelity outside_load", "git_sha": git_sha(), "wall_s": time.time() - t0,
         "read_at": args.read_at, "sim_args": sim_args, "rows": rows}), indent=1) + "\n")
    print(f"results: {args.out / 'results.json'}")


def table(rows: list[dict], read_at: int) -> str:
    head = ["| cell | concurrency | outside the engines, ms: real | sim: router's constant | + `--outside level` | "
            "+ `--outside load` | cores busy at sends (load) | TTFT mean ms: real | sim load |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    body = [f"| {r['case']} | {r['concurrency']}{' (read)' if r['concurrency'] == read_at else ''} | "
            f"{r['real_gap_ms']:.1f} | {r['sim_none_gap_ms']:.1f} | {r['sim_level_gap_ms']:.1f} | "
            f"{r['sim_load_gap_ms']:.1f} | {r['sim_load_busy_share']:.2f} | {r['real_ttft_mean_ms']:.1f} | "
            f"{r['sim_load_ttft_mean_ms']:.1f} |" for r in rows]
    reads = sorted({(r["case"], r["outside_s_read"], r["outside_busy_s_read"]) for r in rows})
    foot = [f"read at concurrency {read_at}: " + "; ".join(
        f"{case} `--outside level` {o * 1e3:.1f} ms, `--outside load` {b * 1e3:.1f} ms with every core busy"
        for case, o, b in reads)]
    return "\n".join(head + body + [""] + foot)


if __name__ == "__main__":
    main()
