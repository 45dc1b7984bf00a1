"""Does a probe taken now say how fast the engine will run next? (issue 19, item 9)

The calibrated simulation prices steps at one reference speed and scales them to the host's speed around each real
block (experiments/sim_fidelity `--host-scale`). That works only if the probe follows the speed the engine runs at.
Each take here reads both probes, then times a window of the engine's work on a second one-rank engine:
- host_probe's work: its thread's CPU, the median of 3 (host_probe.probe);
- experiments/calibrate/engine_probe's mix: the engine's step CPU;
- the window: calibrate's own prefill measure at 512 new tokens, no cached prefix and on 16 cached, and a decode
  of 8 requests of 256 tokens (the mean gap between tokens).

Per probe, it prints two correlations: with the window just after it (the probe's use), and with its own next take
(what it holds over a few seconds).

    python experiments/calibrate/probe_tracking.py --takes 40      # ~2 minutes; writes results_tracking.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.core.host_probe import probe  # noqa: E402
from framework.core.paths import git_sha, load_script  # noqa: E402
from framework.instance.handle import SyncFace  # noqa: E402

calibrate = load_script(HERE / "run.py")   # (by path: a bare `run` may be another folder's run.py)
EngineProbe = load_script(HERE / "engine_probe.py").EngineProbe

SERIES = ("host_probe", "engine_probe", "extend_512", "extend_512_on_16", "decode_8x256")


def _window(face: SyncFace, rng: random.Random) -> dict:
    return {"extend_512": calibrate._prefill(face, rng, 512, 0, 1),
            "extend_512_on_16": calibrate._prefill(face, rng, 512, 16, 1),
            "decode_8x256": calibrate._decode(face, rng, 8, 256)}


def _corr(a: list[float], b: list[float]) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def summary(takes: list[dict]) -> dict:
    """Per probe: its correlation with each window series and with the windows' geometric mean (`window`), and with
    itself one take later (`lag1`); the same lag for the windows."""
    window = [statistics.geometric_mean([t[k] for k in SERIES[2:]]) for t in takes]
    out = {}
    for k in SERIES:
        xs = [t[k] for t in takes]
        out[k] = {"median_ms": statistics.median(xs) * 1e3, "cv": statistics.pstdev(xs) / statistics.fmean(xs),
                  "lag1": _corr(xs[:-1], xs[1:])}
        if k in SERIES[:2]:
            out[k] |= {"window": _corr(xs, window), **{f"with_{w}": _corr(xs, [t[w] for t in takes])
                                                        for w in SERIES[2:]}}
    out["window"] = {"lag1": _corr(window[:-1], window[1:])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--takes", type=int, default=40)
    ap.add_argument("--out", type=Path, default=HERE / "results_tracking.json")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    _, handle, face = calibrate.profiled_engine(calibrate.CONFIGS["single"], 1)
    rng, takes, t0 = random.Random(1), [], time.time()
    try:
        calibrate._serve(face, [calibrate._text(rng, 64)], 4)             # warm-up
        with EngineProbe() as engine:
            for i in range(args.takes):
                take = {"host_probe": probe(3)["probe_s"], "engine_probe": engine.measure()}
                take |= _window(face, rng)
                takes.append(take)
                print(f"{i + 1:3d} " + " ".join(f"{k} {take[k] * 1e3:6.1f}" for k in SERIES), flush=True)
    finally:
        handle.close()
        handle.terminate()
    out = summary(takes)
    print(f"\n| series | median ms | cv | with itself next take | with the window after it |\n|---|---:|---:|---:|---:|")
    for k in SERIES:
        s = out[k]
        print(f"| {k} | {s['median_ms']:.1f} | {s['cv']:.2f} | {s['lag1']:.2f} | "
              f"{s['window']:.2f} |" if "window" in s else f"| {k} | {s['median_ms']:.1f} | {s['cv']:.2f} | "
              f"{s['lag1']:.2f} | - |")
    print(f"the window's geometric mean, with itself next take: {out['window']['lag1']:.2f}")
    args.out.write_text(json.dumps({"experiment": "probe_tracking", "git_sha": git_sha(), "wall_s": time.time() - t0,
                                    "summary": out, "takes": takes}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
