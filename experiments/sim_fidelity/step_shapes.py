"""Where the calibrated cost model's shape is wrong: the real engines' CPU per step against its price, by step shape.

One run of experiments/router_ablation (servelab's router, 4 one-rank HTTP workers: sim_fidelity's HTTP cells) with
`engine.step_cpu_log`, so every engine step's batch (as the simulator prices it) and its rank's CPU seconds are kept;
then every step is priced by the calibrated profile at its own level, once per `sim.cost.extend` way (batch: an
extend of several requests priced as one request of their tokens; per_request: its attention terms summed request by
request). The host's level divides out: a bin's ratio over its kind's ratio (extend or decode) says how far the
profile's shape is off there, whatever the host's speed, and a right shape reads 1.0 in every bin. The shape error is
the real-CPU-weighted mean of |bin ratio / kind ratio - 1|.

    python experiments/sim_fidelity/step_shapes.py      # both workloads and policies, 2 repeats (~1-2 min)
    python experiments/sim_fidelity/step_shapes.py --workloads multi_turn \
        --out experiments/sim_fidelity/step_shapes_multi_turn
    python experiments/sim_fidelity/step_shapes.py --steps outputs/step_shapes/steps   # price a stored log again

Prints the table and writes results.json and table.md to --out.
"""
from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.contracts.cost import BatchShape, Step  # noqa: E402
from framework.core.paths import git_sha, load_script  # noqa: E402
from framework.runs.sim import cost_model  # noqa: E402

EXTENDS = ("batch", "per_request")
PROFILE = "data/calibration/cpu_amd_epyc_l.json"     # round L's to O's
# the workers' engine and model, as router_ablation starts them (one set serves every cell; the workload does not
# change a step's price)
ABLATION = load_script("experiments/router_ablation/run.py")
WORKERS = ABLATION.WORKLOADS["multi_turn"] + ABLATION.COMMON


def sim_args(profile: str = PROFILE, point: str = "median", between: str = "grid", regime: str = "absorbed") -> list:
    """The calibrated cost model's switches the steps are priced with (sim_fidelity's rounds N and O by default)."""
    return [f"sim.cost.path={profile}", f"sim.cost.point={point}", f"sim.cost.between={between}",
            f"sim.cost.prefix_regime={regime}"]


def shape_of(record: dict) -> BatchShape:
    """A BatchShape from its JSON form (dataclasses.asdict, as engine.step_cpu_log writes it)."""
    return BatchShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})


def read_steps(prefix: str) -> list[tuple[BatchShape, float]]:
    """Every logged step of one-rank engines (one batch each) as (shape, CPU seconds); idle steps left out. A step of
    a larger instance is refused: its ranks each log it, and a DP rank's batch is one group's of the step."""
    steps = []
    for path in sorted(glob.glob(f"{prefix}.*.jsonl")):
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if rec.get("size", 1) != 1 or len(rec["batches"]) != 1:
                sys.exit(f"{path}: a step of an instance of {rec.get('size')} ranks; step_shapes reads one-rank "
                         f"engines only (the HTTP cells' workers)")
            shape = shape_of(rec["batches"][0])
            if shape.mode != "idle":
                steps.append((shape, rec["cpu_s"]))
    return steps


def bin_of(shape: BatchShape) -> str:
    """A step's shape bin: decode by batch size; extend by requests, new tokens and token-weighted cached prefix."""
    n = len(shape.new_tokens)
    if shape.mode == "decode":
        return "decode " + ("b1" if n == 1 else "b2-3" if n < 4 else "b4-7" if n < 8 else "b8+")
    new = sum(shape.new_tokens)
    prefix = sum(x * p for x, p in zip(shape.new_tokens, shape.prefix)) / new
    return (f"extend r{n if n < 3 else '3+'} " + ("n<=128" if new <= 128 else "n<=256" if new <= 256 else "n>256")
            + " " + ("p<=16" if prefix <= 16 else "p<=512" if prefix <= 512 else "p>512"))


def priced(steps: list, extend: str, switches: list[str]) -> list[float]:
    """Each step's price by the calibrated profile at its own level, an extend priced as `extend` says."""
    cost = cost_model(compose(WORKERS + ["mode=sim", "sim.cost=calibrated", f"sim.cost.extend={extend}"] + switches))
    return [cost.step_time(Step((shape,))) for shape, _ in steps]


def by_bin(steps: list, prices: list[float]) -> dict:
    """Per bin: steps, real and priced seconds, their ratio and that ratio over its kind's."""
    bins, kinds = {}, {}
    for (shape, cpu), price in zip(steps, prices):
        for table, key in ((bins, bin_of(shape)), (kinds, shape.mode)):
            row = table.setdefault(key, {"steps": 0, "real_s": 0.0, "priced_s": 0.0})
            row["steps"] += 1
            row["real_s"] += cpu
            row["priced_s"] += price
    for key, row in bins.items():
        kind = kinds[key.split()[0]]
        row["ratio"] = row["real_s"] / row["priced_s"]
        row["vs_kind"] = row["ratio"] / (kind["real_s"] / kind["priced_s"])
    for row in kinds.values():
        row["ratio"] = row["real_s"] / row["priced_s"]
    return {"bins": dict(sorted(bins.items())), "kinds": kinds, "shape_error": {
        kind: sum(r["real_s"] * abs(r["vs_kind"] - 1) for k, r in bins.items() if k.startswith(kind))
        / kinds[kind]["real_s"] for kind in kinds}}


def table(result: dict) -> str:
    ways = result["extend"]
    head = "| bin | steps | real CPU s | " + " | ".join(f"{w}: ratio / over its kind's" for w in ways) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(ways)]
    first = result["priced"][ways[0]]["bins"]
    for key, row in first.items():
        cells = [f"{result['priced'][w]['bins'][key]['ratio']:.2f} / {result['priced'][w]['bins'][key]['vs_kind']:.2f}"
                 for w in ways]
        lines.append(f"| {key} | {row['steps']} | {row['real_s']:.2f} | " + " | ".join(cells) + " |")
    for kind, row in result["priced"][ways[0]]["kinds"].items():
        cells = [f"{result['priced'][w]['kinds'][kind]['ratio']:.2f} (shape error "
                 f"{100 * result['priced'][w]['shape_error'][kind]:.1f}%)" for w in ways]
        lines.append(f"| **{kind}, all** | {row['steps']} | {row['real_s']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["shared_prefix", "multi_turn"],
                    choices=["shared_prefix", "multi_turn"])
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--point", choices=["fastest", "median"], default="median")
    ap.add_argument("--between", choices=["fit", "grid"], default="grid")
    ap.add_argument("--prefix-regime", choices=["smooth", "absorbed"], default="absorbed")
    ap.add_argument("--steps", help="a stored step log's prefix: price it again, run nothing")
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "step_shapes")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "step_shapes")
    args = ap.parse_args()
    prefix = args.steps or str(args.work / "steps")
    if not args.steps:
        args.work.mkdir(parents=True, exist_ok=True)
        for old in glob.glob(f"{prefix}.*.jsonl"):
            Path(old).unlink()
        subprocess.run([sys.executable, str(ROOT / "experiments/router_ablation/run.py"), "--impls", "servelab",
                        "--policies", *args.policies, "--workloads", *args.workloads, "--repeats", str(args.repeats),
                        "--out", str(args.work / "router_ablation"), "--overrides", f"engine.step_cpu_log={prefix}"],
                       check=True, cwd=ROOT)
    steps = read_steps(prefix)
    if not steps:
        sys.exit(f"no steps logged under {prefix}.*.jsonl")
    switches = sim_args(args.profile, args.point, args.between, args.prefix_regime)
    result = {"experiment": "step_shapes", "git_sha": git_sha(), "steps_logged": len(steps), "step_log": prefix,
              "workloads": args.workloads, "policies": args.policies, "repeats": args.repeats, "sim_args": switches,
              "extend": list(EXTENDS),
              "median_step_cpu_ms": 1e3 * statistics.median(cpu for _, cpu in steps),
              "priced": {w: by_bin(steps, priced(steps, w, switches)) for w in EXTENDS}}
    text = table(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "table.md").write_text(f"{len(steps)} steps of {', '.join(args.workloads)} x "
                                       f"{', '.join(args.policies)}, {args.repeats} repeat(s); {' '.join(switches)}"
                                       f"\n\n{text}\n")
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
