"""An HTTP worker's own CPU per request, outside its engine's steps (issue 19, item 9): what `sim.cost.serving=
measured` prices in series with the steps.

One real worker behind servelab's router plays bench_serving's random workload (its own prompts, not a fidelity
run's) at two answer lengths. Over each run, the worker process's CPU (`server_process_cpu_s`: its HTTP side, the
rank loop between steps, and its one-rank engine) less its engine thread's CPU in steps (`extend_cpu_s` +
`decode_cpu_s`) is the serving work; a line through (answer tokens, CPU per request) gives a per-request and a
per-token term. Medians of --repeats. Written into the calibration profile (data/calibration/cpu.json, key
`serving`) with this host's probe. Where the profile's points are expressed at its reference speed (experiments/
calibrate/run.py `--normalize pinned`), so is this: each run is preceded by the host's speed (host_probe.pinned), and
the CPU is scaled by the reference / their mean; the CPU as measured stays beside it (`per_request_by_output_raw`).

    python experiments/calibrate/serving.py                 # ~2 minutes on the shared 2-core CPU
    python experiments/calibrate/serving.py --quick --out /tmp/c.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.cluster.cluster import Cluster  # noqa: E402
from framework.cluster.figures import bench  # noqa: E402
from framework.config import compose  # noqa: E402
from framework.core.host_probe import pinned, probe  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from plugins.cost.calibrated import DEFAULT_PATH, reference_pinned_s  # noqa: E402

OUTPUTS = (8, 32)            # answer tokens: the two points of the line
BASE = ["cluster.instances=1", "router=round_robin", "router.port=0", "logger.mode=disabled", "seed=0",
        "workload=random", "workload.input_len=256", "workload.max_concurrency=4", "workload.sample_interval_s=0"]


def measure(cluster: Cluster, cfg) -> float:
    """One run: the worker's CPU outside its steps, per completed request."""
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    cluster.flush_caches()
    results, _ = bench(cluster, cfg, sessions)
    outside = results["server_process_cpu_s"] - results["extend_cpu_s"] - results["decode_cpu_s"]
    return outside / max(results["requests_completed"], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="a few requests, one repeat: the smoke test")
    ap.add_argument("--out", type=Path, default=ROOT / DEFAULT_PATH, help="the profile to add the measurement to")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    repeats, n = (1, 8) if args.quick else (args.repeats, args.requests)
    cfgs = {o: compose(BASE + [f"workload.num_prompts={n}", f"workload.output_len={o}"]
                       + (["workload.input_len=32"] if args.quick else [])) for o in OUTPUTS}
    t0, host = time.perf_counter(), probe()
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    ref = reference_pinned_s(data.get("host_probe"))
    raw: dict[int, list[float]] = {o: [] for o in OUTPUTS}
    speeds: list[float] = []
    cluster = Cluster(cfgs[OUTPUTS[0]])
    try:
        cluster.start()
        cluster.warm_up()
        for _ in range(repeats):                    # interleaved: both lengths see the same drift
            for o, cfg in cfgs.items():
                speeds.append(pinned())
                raw[o].append(measure(cluster, cfg))
    finally:
        cluster.stop()
    scale = ref / statistics.fmean(speeds) if ref else 1.0                      # to the profile's reference speed
    per_request = {o: [v * scale for v in vs] for o, vs in raw.items()}
    med = {o: statistics.median(v) for o, v in per_request.items()}
    (o1, o2) = OUTPUTS
    per_token = max((med[o2] - med[o1]) / (o2 - o1), 0.0)
    request = max(med[o1] - per_token * o1, 0.0)
    serving = {"request_cpu_s": request, "token_cpu_s": per_token,
               "per_request_by_output": {str(o): v for o, v in per_request.items()},
               "per_request_by_output_raw": {str(o): v for o, v in raw.items()}, "pinned_s": speeds,
               "normalized_to_pinned_s": ref, "overrides": BASE,
               "requests": n, "repeats": repeats, "host_probe": host, "git_sha": git_sha(),
               "wall_s": time.perf_counter() - t0}
    data["serving"] = serving
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(" ".join(f"{o} tokens: {med[o] * 1e3:.2f} ms/request" for o in OUTPUTS)
          + f" -> {request * 1e3:.2f} ms per request + {per_token * 1e3:.3f} ms per answer token; wrote {args.out} "
          f"({serving['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
