"""How much slower the engine's own steps run while another core is busy with an engine too (issue 19, item 9):
`sim.host_contention` (decode steps) and `sim.host_contention_extend` (steps that extend).

This VM's two vCPUs slow each other (framework/core/host_probe.contention: the probe's work 1.07-1.25x slower with
both busy), but not every kind of work alike: in the fidelity runs the real engines' extend CPU rose 1.07x under load
and their decode CPU 1.2-1.4x. So this measures the engine's steps themselves: one single-rank instance (as
experiments/calibrate profiles it) times a few prefill and decode points alone, then beside a sibling process that
keeps another instance of the same engine busy (prefills and decodes of random prompts), alternating alone / beside
--rounds times so that the host's drift hits both alike. Per kind: the geometric mean over its points of each point's
median beside / median alone.

    python experiments/calibrate/contention.py            # ~1-2 minutes; prints and returns the factors
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from framework.config import compose  # noqa: E402
from framework.instance.client import open_engine  # noqa: E402
from framework.instance.handle import SyncFace  # noqa: E402
from framework.instance.rank_loop import InstanceSpec  # noqa: E402

PREFILL = [(256, 0), (512, 256)]      # (new tokens, cached prefix)
DECODE = [(8, 256), (16, 256)]        # (requests, prompt tokens)
OVERRIDES = ["parallel=single", "moe=reference", "engine.kv_budget_mb=64", "logger.mode=disabled"]


def _engine(seed: int = 0):
    cfg = compose(OVERRIDES)
    handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, seed))
    return handle, SyncFace(handle)


def _sibling() -> None:
    """Keep an engine busy until stopped: random prompts, prefilled then decoded, two at a time."""
    import torch
    from run import _serve, _text                              # experiments/calibrate/run.py
    torch.set_num_threads(1)
    handle, face = _engine(seed=1)
    rng = random.Random(1)
    print("ready", flush=True)
    try:
        while True:
            _serve(face, [_text(rng, rng.choice([64, 256, 512])) for _ in range(2)], rng.choice([4, 16]))
    finally:
        handle.close()
        handle.terminate()


def measure(rounds: int = 2, repeats: int = 3) -> dict:
    """The factors per kind (``extend``, ``decode``) and each point's medians alone and beside the sibling."""
    import torch
    from run import _decode, _prefill, _serve, _text           # experiments/calibrate/run.py
    torch.set_num_threads(1)
    handle, face = _engine()
    rng = random.Random(0)
    points = [("extend", (n, p), lambda n=n, p=p: _prefill(face, rng, n, p, 1)) for n, p in PREFILL] + \
             [("decode", (b, c), lambda b=b, c=c: _decode(face, rng, b, c)) for b, c in DECODE]
    times = {(kind, p, side): [] for kind, p, _ in points for side in ("alone", "beside")}
    try:
        _serve(face, [_text(rng, 64)], 4)                          # warm-up
        for _ in range(rounds):
            for side in ("alone", "beside"):
                sibling = None
                if side == "beside":
                    sibling = subprocess.Popen([sys.executable, __file__, "--sibling"], stdout=subprocess.PIPE,
                                               text=True, cwd=ROOT)
                    if sibling.stdout.readline().strip() != "ready":
                        raise RuntimeError("the busy sibling engine did not start")
                    time.sleep(0.5)
                try:
                    for kind, p, run in points:
                        times[(kind, p, side)] += [run() for _ in range(repeats)]
                finally:
                    if sibling is not None:
                        sibling.terminate()
                        sibling.wait(timeout=30)
    finally:
        handle.close()
        handle.terminate()
    ratios = {kind: [] for kind in ("extend", "decode")}
    per_point = []
    for kind, p, _ in points:
        alone, beside = (statistics.median(times[(kind, p, s)]) for s in ("alone", "beside"))
        ratios[kind].append(beside / alone)
        per_point.append({"kind": kind, "point": list(p), "alone_s": alone, "beside_s": beside})
    factors = {kind: math.exp(statistics.fmean(math.log(r) for r in rs)) for kind, rs in ratios.items()}
    return {**factors, "points": per_point, "rounds": rounds, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sibling", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.sibling:
        return _sibling()
    t0 = time.perf_counter()
    out = measure(args.rounds, args.repeats)
    print(json.dumps({k: v for k, v in out.items() if k != "points"}))
    print(f"engine contention: extend {out['extend']:.3f}, decode {out['decode']:.3f} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
