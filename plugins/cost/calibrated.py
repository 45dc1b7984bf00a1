"""sim/cost=calibrated: step times measured on the real engine of this machine (experiments/calibrate), interpolated.

The profile holds, per instance config (parallel x size, moe), a prefill grid (new tokens x cached prefix: one
request's time to first token on an idle instance) and a decode grid (requests x prompt tokens: the gap between
tokens). Points measured on a shared machine are noisy, so each grid is fitted by least squares (relative error) to
the shape of a step's work, and the fit is what prices a step:

- EXTEND batch of n new tokens on a cached prefix of p (token-weighted mean): c0 + c1 n + c2 n p + c3 n^2;
- DECODE batch of b requests of mean context c: c0 + c1 b + c2 b c, with b = n x DP groups for a group of n (the
  profile's decode batches were spread evenly over the DP groups);
- the step: its slowest batch (the ranks wait for each other at every layer); IDLE batches cost nothing.

Only what was profiled can be priced: another model or config is refused with the calibrated ones listed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from framework.core.registry import COST
from framework.contracts.cost import CostConfig, CostModel, InstanceShape, Step

DEFAULT_PATH = "data/calibration/cpu.json"
ROOT = Path(__file__).resolve().parents[2]


def config_key(parallel: str, size: int, moe: str) -> str:
    return f"{parallel}x{size}/{moe}"


@dataclass
class CalibratedConfig(CostConfig):
    name: str = "calibrated"
    path: str = DEFAULT_PATH          # the profile (relative: to the repository)


PREFILL_TERMS = (lambda n, p: 1.0, lambda n, p: n, lambda n, p: n * p, lambda n, p: n * n)
DECODE_TERMS = (lambda b, c: 1.0, lambda b, c: b, lambda b, c: b * c)


def prefill_time(coef: list[float], n: float, p: float) -> float:
    """PREFILL_TERMS' sum, written out (the simulator's hot path)."""
    return coef[0] + n * (coef[1] + coef[2] * p + coef[3] * n)


def decode_time(coef: list[float], b: float, c: float) -> float:
    """DECODE_TERMS' sum, written out."""
    return coef[0] + b * (coef[1] + coef[2] * c)


class Fit:
    """seconds ~ sum_i coef_i term_i(x, y), fitted by least squares on the grid's relative errors; the coefficients
    are kept >= 0 (a term that fits negative is dropped and the rest refitted) so no step costs less with more work."""

    def __init__(self, terms, xs: list[float], ys: list[float], seconds: list[list[float]]):
        import numpy as np
        points = [(x, y, s) for x, row in zip(xs, seconds) for y, s in zip(ys, row)]
        keep = list(range(len(terms)))
        while True:
            a = np.array([[terms[i](x, y) / s for i in keep] for x, y, s in points])
            coef = np.linalg.lstsq(a, np.ones(len(points)), rcond=None)[0]
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        self.coef = [0.0] * len(terms)                                  # a dropped term: 0
        for i, c in zip(keep, coef):
            self.coef[i] = max(float(c), 0.0)
        self.error = float(np.sqrt(np.mean((a @ coef - 1) ** 2)))     # RMS relative error on the grid


def load_profile(path: str, instance: InstanceShape) -> dict:
    p = Path(path) if Path(path).is_absolute() else ROOT / path
    if not p.exists():
        raise ValueError(f"sim.cost.path={path}: no calibration there; run experiments/calibrate/run.py first")
    data = json.loads(p.read_text())
    key = config_key(instance.parallel, instance.size, instance.moe)
    if instance.model.name != data["model"] or key not in data["profiles"]:
        raise ValueError(f"sim.cost=calibrated has no profile of model={instance.model.name} {key} in {path} "
                         f"(calibrated: model={data['model']} with {', '.join(data['profiles'])}); profile it with "
                         f"experiments/calibrate/run.py, or use sim.cost=roofline")
    return data["profiles"][key]


@COST.register("calibrated")
class CalibratedCost(CostModel):
    Config = CalibratedConfig
    cuda_graphs = False             # profiled on this CPU: the engine captures no graph there
    reads_hardware = False          # this machine's engine, as profiled: `hardware=` prices nothing here

    def __init__(self, cfg: CalibratedConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        prof = load_profile(cfg.path, instance)
        pre, dec = prof["prefill"], prof["decode"]
        self.prefill = Fit(PREFILL_TERMS, pre["new"], pre["prefix"], pre["seconds"])
        self.decode = Fit(DECODE_TERMS, dec["batch"], dec["context"], dec["seconds"])
        self._pc, self._dc = self.prefill.coef, self.decode.coef

    def step_time(self, step: Step) -> float:
        groups, t = len(step.batches), 0.0
        for b in step.batches:
            n = len(b.new_tokens)
            if b.mode == "idle" or not n:
                continue
            if b.mode == "decode":
                bt = decode_time(self._dc, groups * n, sum(b.prefix) / n)
            else:
                new = sum(b.new_tokens)
                bt = prefill_time(self._pc, new, sum(x * p for x, p in zip(b.new_tokens, b.prefix)) / new)
            t = bt if bt > t else t
        return t

    def decode_times(self, sizes: tuple[int, ...], contexts: tuple[int, ...], k: int,
                     graph: bool = False) -> list[float]:
        """As step_time would price each step of the run (the same arithmetic), without building the steps."""
        groups, coef = len(sizes), self._dc
        busy = [(groups * n, n, c) for n, c in zip(sizes, contexts) if n]
        if len(busy) == 1:
            (b, n, c), = busy
            return [decode_time(coef, b, (c + j * n) / n) for j in range(k)]
        return [max(decode_time(coef, b, (c + j * n) / n) for b, n, c in busy) for j in range(k)]
