"""The host's speed as the engine feels it: a fixed piece of the engine's own work (issue 19, item 9).

framework/core/host_probe's work (small matmuls and a Python loop, cache-resident) stamps a host and finds one that is
3x slower. It does not follow the minute-to-minute speed of this AMD EPYC VM as the engine runs, though. Measured
2026-12-04 (experiments/calibrate/probe_tracking.py, results_tracking.json: 40 takes ~2 s apart): the probe's work
(cv 0.21) correlated 0.09 with the engine's work in the seconds just after it; this mix 0.51.

So this times a fixed mix of the engine's own steps on a one-rank engine (experiments/calibrate's `single` config),
opened once (calibrate/contention.py's) and idle between takes:
- extends of 512 new tokens, with no cached prefix and on 16 cached (the engine's two attention forms);
- a decode of 8 requests of 256 tokens (16 steps).

Fresh prompts each take, same shapes. Its seconds are the engine thread's CPU in those steps (the engine's
`extend_cpu_s` + `decode_cpu_s`): the core's speed, not the time others took from it. host_probe's thread clock counts
the same way; steal and other work are simulated apart.

    python experiments/calibrate/engine_probe.py --takes 5      # prints each take's seconds
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.core.paths import load_script  # noqa: E402
from framework.engine.stats import STEP_CPU_KEYS  # noqa: E402

calibrate = load_script(HERE / "run.py")   # (by path: a bare `run` may be another folder's run.py)

EXTENDS = [(512, 0), (512, 16)] * 2          # (new tokens, cached prefix)
DECODE = (8, 256, 16)                         # requests, prompt tokens, tokens each


class EngineProbe:
    """A one-rank engine kept for ``measure``: the engine thread's step CPU over the fixed mix (module doc)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed, self.handle = seed, None

    def __enter__(self) -> "EngineProbe":
        _, self.handle, self.face = calibrate.profiled_engine(calibrate.CONFIGS["single"], self.seed)
        self.rng = random.Random(self.seed)
        calibrate._serve(self.face, [calibrate._text(self.rng, 64)], 4)          # warm-up
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()
        self.handle.terminate()

    def _cpu(self) -> float:
        stats = self.handle.stats()
        return sum(stats.get(k, 0.0) for k in STEP_CPU_KEYS)

    def measure(self) -> float:
        """The engine thread's CPU seconds in the mix's steps (its stats come fresh with the finish that drains it)."""
        c, face, rng = calibrate, self.face, self.rng
        before = self._cpu()
        for new, cached in EXTENDS:
            prefix = c._cached_prefix(face, rng, cached)   # (served first, when cached: part of the mix)
            c._serve(face, [prefix + c._text(rng, new)], 1)
        n, length, tokens = DECODE
        c._serve(face, [c._text(rng, length) for _ in range(n)], tokens)
        after = self._cpu()
        if not after > before:
            raise RuntimeError("engine probe: the engine's step CPU did not move over the mix (its stats not fresh?)")
        return after - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--takes", type=int, default=5)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    with EngineProbe() as probe:
        takes = []
        for _ in range(args.takes):
            t0 = time.perf_counter()
            takes.append(probe.measure())
            print(f"{takes[-1] * 1e3:.1f} ms of step CPU ({time.perf_counter() - t0:.2f} s)", flush=True)
    print(f"median {statistics.median(takes) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
