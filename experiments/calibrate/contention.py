"""How much slower the engine's own steps run while other engines keep the cores busy (issue 19, item 9):
`sim.host_contention` (decode steps) and `sim.host_contention_extend` (steps that extend).

This VM's two vCPUs slow each other (framework/core/host_probe.contention: the probe's work 1.07-1.25x slower with
both busy), but not every kind of work alike: in the fidelity runs the real engines' extend CPU rose 1.07x under load
and their decode CPU 1.2-1.4x. So this measures the engine's steps themselves: one single-rank instance (as
experiments/calibrate profiles it) times a few prefill and decode points alone, then beside a sibling process that
keeps another instance of the same engine busy (prefills and decodes of random prompts), alternating alone / beside
--rounds times so that the host's drift hits both alike. Per kind: the geometric mean over its points of each point's
median beside / median alone. `--siblings N` keeps N sibling engines busy, unpinned, as a cell of N + 1 one-rank
workers has them (sim_fidelity's HTTP cells: 4 workers on 2 cores, `--siblings 3`); round F measured with one.
Each point's seconds are its wall time (`--clock wall`, round F's: with one sibling on two cores nobody waits for a
core) or the engine thread's CPU in the point's steps of its kind, per step (`--clock cpu`): with more engines than
cores the wall time holds the sharing of the cores, which the simulator does itself (`sim.host_cores`); the thread's
clock holds only how much slower a step runs while it has a core.

    python experiments/calibrate/contention.py            # ~1-2 minutes; prints and returns the factors
    python experiments/calibrate/contention.py --siblings 3
"""
from __future__ import annotations

import argparse
import functools
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

from framework.core.paths import load_script  # noqa: E402

calibrate = load_script(HERE / "run.py")   # (by path: a bare `run` may be another folder's run.py)

PREFILL = [(256, 0), (512, 256)]      # (new tokens, cached prefix)
DECODE = [(8, 256), (16, 256)]        # (requests, prompt tokens)
CLOCKS = ("wall", "cpu")


def one_rank_engine(seed: int = 0):
    """The one-rank engine measured here: calibrate/run.py's, as its profile opens it."""
    _, handle, face = calibrate.profiled_engine(calibrate.CONFIGS["single"], seed)
    return handle, face


def _sibling(seed: int = 1) -> None:
    """Keep an engine busy until stopped: random prompts, prefilled then decoded, two at a time."""
    import torch
    torch.set_num_threads(1)
    handle, face = one_rank_engine(seed)
    rng = random.Random(seed)
    print("ready", flush=True)
    try:
        while True:
            prompts = [calibrate._text(rng, rng.choice([64, 256, 512])) for _ in range(2)]
            calibrate._serve(face, prompts, rng.choice([4, 16]))
    finally:
        handle.close()
        handle.terminate()


def _start_siblings(n: int) -> list[subprocess.Popen]:
    """``n`` busy sibling engines (``_sibling``, seeds 1..n), each started and ready."""
    siblings = []
    try:
        for seed in range(1, n + 1):
            siblings.append(subprocess.Popen([sys.executable, __file__, "--sibling", str(seed)],
                                             stdout=subprocess.PIPE, text=True, cwd=ROOT))
            if siblings[-1].stdout.readline().strip() != "ready":
                raise RuntimeError(f"busy sibling engine {seed} of {n} did not start")
    except BaseException:
        _stop(siblings)
        raise
    return siblings


def _stop(siblings: list[subprocess.Popen]) -> None:
    for sibling in siblings:
        sibling.terminate()
    for sibling in siblings:
        try:
            sibling.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sibling.kill()
            sibling.wait()


def _step_cpu(handle, kind: str, serve) -> float:
    """The engine thread's CPU per step of ``kind`` (extend, decode) over ``serve()``."""
    def read():
        stats = handle.stats()
        return stats[f"{kind}_cpu_s"], stats[f"{kind}_steps"]
    (cpu0, steps0), _, (cpu1, steps1) = read(), serve(), read()
    if not steps1 > steps0:
        raise RuntimeError(f"contention: no {kind} step counted over the point (the engine's stats not fresh?)")
    return (cpu1 - cpu0) / (steps1 - steps0)


def measure(rounds: int = 2, repeats: int = 3, siblings: int = 1, clock: str = "wall") -> dict:
    """The factors per kind (``extend``, ``decode``) and each point's medians alone and beside ``siblings`` busy
    sibling engines, timed by ``clock`` (module doc)."""
    if siblings < 1:
        raise ValueError(f"siblings={siblings}: at least one busy sibling engine is needed to measure beside it")
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not one of {CLOCKS}")
    import torch
    _serve, _text = calibrate._serve, calibrate._text
    torch.set_num_threads(1)
    handle, face = one_rank_engine()
    rng = random.Random(0)

    def extend(n: int, p: int) -> float:
        if clock == "wall":
            return calibrate._prefill(face, rng, n, p, 1)
        prefix = calibrate._cached_prefix(face, rng, p)
        return _step_cpu(handle, "extend", lambda: _serve(face, [prefix + _text(rng, n)], 1))

    def decode(b: int, n: int) -> float:
        if clock == "wall":
            return calibrate._decode(face, rng, b, n)
        prompts = [_text(rng, n) for _ in range(b)]
        return _step_cpu(handle, "decode", lambda: _serve(face, prompts, calibrate.DECODE_TOKENS))

    points = [("extend", (n, p), functools.partial(extend, n, p)) for n, p in PREFILL] + \
             [("decode", (b, n), functools.partial(decode, b, n)) for b, n in DECODE]
    times = {(kind, p, side): [] for kind, p, _ in points for side in ("alone", "beside")}
    try:
        _serve(face, [_text(rng, 64)], 4)                          # warm-up
        for _ in range(rounds):
            for side in ("alone", "beside"):
                busy = []
                if side == "beside":
                    busy = _start_siblings(siblings)
                    time.sleep(0.5)
                try:
                    for kind, p, run in points:
                        times[(kind, p, side)] += [run() for _ in range(repeats)]
                finally:
                    _stop(busy)
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
    return {**factors, "points": per_point, "rounds": rounds, "repeats": repeats, "siblings": siblings,
            "clock": clock}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sibling", type=int, default=None, help=argparse.SUPPRESS)    # (a busy sibling: its seed)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--siblings", type=int, default=1, help="busy sibling engines beside the measured one")
    ap.add_argument("--clock", choices=CLOCKS, default="wall", help="a point's wall time, or its steps' thread CPU")
    args = ap.parse_args()
    if args.sibling is not None:
        return _sibling(args.sibling)
    t0 = time.perf_counter()
    out = measure(args.rounds, args.repeats, args.siblings, args.clock)
    print(json.dumps({k: v for k, v in out.items() if k != "points"}))
    print(f"engine contention beside {args.siblings} busy engine(s), {args.clock} clock: "
          f"extend {out['extend']:.3f}, decode {out['decode']:.3f} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
