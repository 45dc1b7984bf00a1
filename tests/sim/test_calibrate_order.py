"""experiments/calibrate's prefill sweeps: interleaved (every point once per sweep, in a shuffled order, the host taken
before each sweep) or point by point; both on a real one-rank engine."""
from __future__ import annotations

import random

import pytest

from script_loader import load_script

from framework.config import compose
from framework.core.host_probe import Cores
from framework.instance.client import open_engine
from framework.instance.handle import SyncFace
from framework.instance.rank_loop import InstanceSpec

GRID = {"new": [8, 16, 24], "prefix": [0, 16]}      # not square: a transposed point would show


@pytest.mark.parametrize("interleaved", [True, False])
def test_each_prefill_point_gets_its_repeats_and_the_host_before_it(monkeypatch, interleaved):
    calibrate = load_script("experiments/calibrate/run.py")
    seen, values, readings = [], {}, []
    real = calibrate._prefill

    def recorded(face, rng, n, p, dp):
        seen.append((n, p))
        values.setdefault((n, p), []).append(real(face, rng, n, p, dp))
        return values[n, p][-1]

    class Recorded(Cores):                 # the real cores' readings, each kept as the grid took it
        def measure(self, seconds, *args):
            readings.append(super().measure(seconds, *args))
            return readings[-1]

    monkeypatch.setattr(calibrate, "_prefill", recorded)
    cfg = compose(calibrate.CONFIGS["single"] + ["engine.kv_budget_mb=64", "logger.mode=disabled"])
    handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, 0))
    speeds = []
    try:
        with Recorded() as cores:
            got = calibrate._prefill_grid(SyncFace(handle), random.Random(3), GRID, 2, 1, handle, cores, speeds,
                                          interleaved)
    finally:
        handle.close()
        handle.terminate()
    points = [(n, p) for n in GRID["new"] for p in GRID["prefix"]]
    assert [[len(r) for r in row] for row in got] == [[2, 2]] * 3
    assert all(s > 0 for row in got for r in row for s in r)
    assert all(got[i][j] == values[n, p] for i, n in enumerate(GRID["new"]) for j, p in enumerate(GRID["prefix"]))
    assert sorted(seen) == sorted(points * 2)
    assert len(speeds) == len(points) and all(s["pinned_s"] > 0 for s in speeds)
    if interleaved:       # each sweep visits every point once, the host the same for all (the sweeps' mean)
        assert all(sorted(seen[k * 6:(k + 1) * 6]) == sorted(points) for k in range(2))
        assert len(readings) == 2 and all(s["pinned_s"] == pytest.approx(
            (readings[0]["pinned_s"] + readings[1]["pinned_s"]) / 2) for s in speeds)
    else:                 # a point's repeats back to back, the host taken before each point
        assert seen == [pt for pt in points for _ in range(2)]
        assert [s["pinned_s"] for s in speeds] == [r["pinned_s"] for r in readings]
