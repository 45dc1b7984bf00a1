"""The calibration profile's host stamp (framework/core/host_probe.py): a probe of this host, and what makes a
stamped profile not describe it."""
from __future__ import annotations

import pytest

from framework.core.host_probe import TOLERANCE, mismatch, probe


def test_a_probe_times_this_host_and_matches_itself():
    now = probe(repeats=1)
    assert now["probe_s"] > 0 and now["cpu_count"] >= 1 and now["cpu_model"]
    assert mismatch(now, now) == []


def test_another_speed_another_cpu_or_no_stamp_each_named():
    now = {"cpu_model": "AMD EPYC", "cpu_count": 2, "probe_s": 0.030}
    assert mismatch({**now, "probe_s": 0.030 / (1 + TOLERANCE / 2)}, now) == []          # inside the tolerance
    slower, = mismatch({**now, "probe_s": 0.010}, now)                                    # the host got 3x slower
    assert "3.00x" in slower
    assert any("CPU model" in p for p in mismatch({**now, "cpu_model": "Intel Xeon"}, now))
    assert any("4 cores" in p for p in mismatch(now, {**now, "cpu_count": 4}))
    cached = {**now, "cpu_cache": "107520 KB"}   # a hypervisor names every Xeon alike: its cache tells them apart
    assert any("another CPU" in p for p in mismatch({**cached, "cpu_cache": "36608 KB"}, cached))
    assert mismatch(now, cached) == []           # a stamp from before caches were recorded: not checked on it
    no_stamp, = mismatch(None, now)
    assert "experiments/calibrate/run.py" in no_stamp


@pytest.mark.long      # ~12 s on this host: four processes that each import torch
def test_contention_pins_the_probe_to_each_core_alone_then_to_all():
    import os
    from framework.core.host_probe import contention
    out = contention(seconds=0.05)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        assert out["contention"] == 1.0
        return
    assert out["cpus"] == cpus and len(out["alone_s"]) == len(out["together_s"]) == len(cpus)
    assert out["contention"] == pytest.approx(sum(out["together_s"]) / sum(out["alone_s"])) and out["contention"] > 0


def test_a_stamp_with_a_pinned_speed_is_checked_pinned():
    now = {"cpu_model": "AMD EPYC", "cpu_count": 2, "probe_s": 0.015, "pinned_s": 0.0100}
    stamp = {**now, "probe_s": 0.009, "pinned_s": 0.0101}        # the unpinned probe placed on the fast core then
    assert mismatch(stamp, now) == []
    slower, = mismatch({**stamp, "pinned_s": 0.005}, now)
    assert "pinned probe takes 2.00x" in slower
    assert mismatch({k: v for k, v in stamp.items() if k != "pinned_s"}, now)   # no pinned stamp: the probe's 1.67x


def test_slowdown_is_linear_in_the_other_cores_busy():
    from framework.sim.cluster import slowdown
    assert slowdown(1.5, 2, 2) == pytest.approx(1.5) and slowdown(1.5, 1, 2) == 1.0
    assert slowdown(1.5, 1.5, 2) == pytest.approx(1.25) and slowdown(1.5, 5, 2) == pytest.approx(1.5)   # capped
    assert slowdown(1.6, 2, 4) == pytest.approx(1.2) and slowdown(1.5, 2, 1) == 1.0 and slowdown(1.0, 2, 2) == 1.0
