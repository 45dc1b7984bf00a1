"""The engine probe (experiments/calibrate/engine_probe.py): the engine's own step CPU over a fixed mix, on a real
one-rank engine; the scale sim_fidelity's --host-scale engine takes from it; probe_tracking's correlations."""
from __future__ import annotations

import sys

import pytest

from framework.core.host_probe import Cores
from script_loader import ROOT, load_script


BY_BARE_NAME = ("engine_probe", "contention")      # experiments/calibrate's scripts import these siblings so


@pytest.fixture
def calibrate_folder(monkeypatch):
    """experiments/calibrate on sys.path, as when its scripts run; after the test neither it nor the modules they
    imported by bare name are left (the checkout's root has a run.py of its own)."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments" / "calibrate"))
    for name in BY_BARE_NAME:
        monkeypatch.setitem(sys.modules, name, None)       # (whatever was there comes back after)
        del sys.modules[name]


@pytest.fixture
def engine_probe(calibrate_folder):
    return load_script("experiments/calibrate/engine_probe.py")


def test_the_mix_reads_the_engines_step_cpu_and_a_calibrate_reading_carries_it(engine_probe):
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with engine_probe.EngineProbe() as probe:
            takes = [probe.measure() for _ in range(2)]
            calibrate = load_script("experiments/calibrate/run.py")
            with Cores() as cores:
                reading = calibrate.Readings(cores, probe).measure(0.05)
    finally:
        torch.set_num_threads(threads)
    # four 512-token extends and 16 decode steps of 8: tens of ms at least, and the two takes of one size
    assert all(t > 0.02 for t in takes) and max(takes) < 3 * min(takes)
    assert reading["pinned_s"] > 0 and reading["engine_s"] > 0.02


def test_engine_scale_divides_the_blocks_engine_readings_by_the_profiles():
    f = load_script("experiments/sim_fidelity/run.py")
    record = {"host_pinned_s": [0.010, 0.014], "host_engine_s": [0.9, 1.1], "host_contentions": [1.0, 1.2],
              "host_collective_s": None}
    assert f.block_host(record, 0.8, False, False, "host_engine_s")[0] == pytest.approx(1.25)
    assert f.block_host(record, 0.012, False, False)[0] == pytest.approx(1.0)        # host_probe's, the default
    assert f.block_host(record, None, False, False, "host_engine_s")[0] == 1.0       # --host-scale none


def test_tracking_says_which_probe_follows_the_engine(calibrate_folder):
    tracking = load_script("experiments/calibrate/probe_tracking.py")
    speeds = [1.0, 2.0] * 4                                    # the host's speed, take by take
    noise = [1.0, 1.0, 2.0, 2.0] * 2                           # unrelated to it (correlation 0)
    takes = [{"host_probe": n, "engine_probe": 0.8 * s, "extend_512": 0.1 * s, "extend_512_on_16": 0.12 * s,
              "decode_8x256": 0.01 * s} for s, n in zip(speeds, noise)]
    out = tracking.summary(takes)
    assert out["engine_probe"]["window"] == pytest.approx(1.0)
    assert out["host_probe"]["window"] == pytest.approx(0.0, abs=1e-9)
    assert out["engine_probe"]["lag1"] == pytest.approx(-1.0)          # fast, then slow, then fast
    assert out["engine_probe"]["with_extend_512"] == pytest.approx(1.0)


def test_a_profile_as_measured_gets_a_twin_normalized_by_host_probe(calibrate_folder):
    renormalize = load_script("experiments/calibrate/renormalize.py")
    calibrate = renormalize.calibrate                   # experiments/calibrate/run.py, as renormalize loads it
    prefill = {**calibrate._points([[[1.0, 2.0]] * 4], [{"pinned_s": 0.010}] * 4), "order": "interleaved"}
    decode = calibrate._points([[[4.0, 4.0]] * 4], [{"pinned_s": 0.030}] * 4)
    data = {"profiled_now": ["single"], "host_probe": {"pinned_s": 0.020, "normalized": "none", "engine_s": 0.8},
            "profiles": {"singlex1/reference": {"prefill": prefill, "decode": decode}},
            "serving": {"request_cpu_s": 0.002, "token_cpu_s": 0.0002, "pinned_s": [0.010, 0.010],
                        "per_request_by_output": {"8": [0.003]}, "normalized_to_pinned_s": None}}
    twin = renormalize.pinned_twin(data)
    # its points are no longer as measured: the engine probe's speed is not carried (--host-scale engine refuses it)
    assert twin["host_probe"] == {"pinned_s": pytest.approx(0.020), "normalized": "pinned"}
    grid = twin["profiles"]["singlex1/reference"]
    assert grid["prefill"]["seconds"][0] == pytest.approx([2.0] * 4)        # fastest 1.0, taken at 10 ms: x 20/10
    assert grid["decode"]["seconds"][0] == pytest.approx([4.0 * 2 / 3] * 4)
    # serving ran at 10 ms against the reference's 20: its CPU counts double, every figure of it
    assert twin["serving"]["request_cpu_s"] == pytest.approx(0.004) and \
        twin["serving"]["token_cpu_s"] == pytest.approx(0.0004) and \
        twin["serving"]["per_request_by_output"] == {"8": [pytest.approx(0.006)]} and \
        twin["serving"]["normalized_to_pinned_s"] == pytest.approx(0.020)
    assert data["host_probe"]["normalized"] == "none" and prefill["seconds"][0] == [1.0] * 4      # left as it was
    with pytest.raises(ValueError, match="normalized is 'pinned'"):
        renormalize.pinned_twin(twin)
    with pytest.raises(ValueError, match="normalized already"):          # serving already at some reference
        renormalize.pinned_twin({**data, "serving": {**data["serving"], "normalized_to_pinned_s": 0.015}})
    kept = {**data, "profiles": {**data["profiles"], "tpx2/triton_fused": {}}}
    with pytest.raises(ValueError, match="measured in the one run"):     # a config kept from an earlier profile
        renormalize.pinned_twin(kept)


def test_each_scale_takes_only_a_profile_measured_for_it():
    f = load_script("experiments/sim_fidelity/run.py")
    as_measured = {"pinned_s": 0.011, "normalized": "none", "engine_s": 0.8}
    normalized = {"pinned_s": 0.011, "normalized": "pinned", "engine_s": 0.8}
    assert f.scale_reference(as_measured, "engine") == (0.8, "host_engine_s")
    assert f.scale_reference(normalized, "pinned") == (0.011, "host_pinned_s")
    assert f.scale_reference(normalized, "none")[0] is None
    engine = {"pinned_s": 0.011, "normalized": "engine", "engine_s": 0.7}
    assert f.scale_reference(engine, "engine") == (0.7, "host_engine_s")
    with pytest.raises(SystemExit, match="normalized to it or kept as measured"):      # rescaled twice otherwise
        f.scale_reference(normalized, "engine")
    with pytest.raises(SystemExit, match="renormalize.py"):
        f.scale_reference(engine, "pinned")
    with pytest.raises(SystemExit, match="renormalize.py"):
        f.scale_reference(as_measured, "pinned")


def test_a_profile_as_measured_gets_a_twin_normalized_by_the_engine_probe(calibrate_folder):
    """Round K scaled a profile as measured to its mean engine reading, where each config had been measured at its
    own: the engine twin puts every point at that mean, by the readings before it, as host_probe's twin does."""
    renormalize = load_script("experiments/calibrate/renormalize.py")
    calibrate = renormalize.calibrate
    fast = {"pinned_s": 0.010, "engine_s": 0.6}               # the one config's prefill points: a fast quarter hour
    slow = {"pinned_s": 0.010, "engine_s": 1.0}
    prefill = {**calibrate._points([[[1.0, 1.0]] * 4], [fast] * 4), "order": "interleaved"}
    decode = calibrate._points([[[3.0, 3.0]] * 4], [slow] * 4)
    serving = {"request_cpu_s": 0.002, "token_cpu_s": 0.0002, "pinned_s": [0.010], "normalized_to_pinned_s": None}
    data = {"profiled_now": ["single"], "host_probe": {"pinned_s": 0.010, "normalized": "none", "engine_s": 0.8},
            "profiles": {"singlex1/reference": {"prefill": prefill, "decode": decode}}, "serving": serving}
    twin = renormalize.engine_twin(data)
    assert twin["host_probe"]["normalized"] == "engine" and twin["host_probe"]["engine_s"] == pytest.approx(0.8)
    grid = twin["profiles"]["singlex1/reference"]
    assert grid["prefill"]["seconds_median"][0] == pytest.approx([1.0 * 0.8 / 0.6] * 4)   # dearer at the mean
    assert grid["decode"]["seconds_median"][0] == pytest.approx([3.0 * 0.8 / 1.0] * 4)    # cheaper
    assert twin["serving"] == serving                                   # serving.py read no engine probe
    f = load_script("experiments/sim_fidelity/run.py")
    assert f.scale_reference(twin["host_probe"], "engine") == (pytest.approx(0.8), "host_engine_s")
    with pytest.raises(ValueError, match="normalized is 'engine'"):
        renormalize.engine_twin(twin)
    no_probe = {**data, "host_probe": {"pinned_s": 0.010, "normalized": "none"}}
    with pytest.raises(ValueError, match="--engine-probe"):
        renormalize.engine_twin(no_probe)


@pytest.mark.long
def test_contention_on_the_cpu_clock_reads_each_steps_thread_cpu_beside_busy_engines(calibrate_folder, monkeypatch):
    """calibrate/contention.py --clock cpu on a real engine beside two real busy sibling engines (a small grid):
    every point is a step's thread CPU (tens of ms for a 512-token extend, a few for a decode step), and the factors
    are the points' ratios beside / alone."""
    contention = load_script("experiments/calibrate/contention.py")
    monkeypatch.setattr(contention, "PREFILL", [(256, 0)])
    monkeypatch.setattr(contention, "DECODE", [(4, 64)])
    out = contention.measure(rounds=1, repeats=2, siblings=2, clock="cpu")
    assert (out["siblings"], out["clock"]) == (2, "cpu")
    extend, decode = out["points"]
    assert 0.003 < extend["alone_s"] < 1.0 and 0.0003 < decode["alone_s"] < extend["alone_s"]
    assert out["extend"] == pytest.approx(extend["beside_s"] / extend["alone_s"])
    assert out["decode"] == pytest.approx(decode["beside_s"] / decode["alone_s"])
    with pytest.raises(ValueError, match="at least one busy sibling"):
        contention.measure(siblings=0)
    with pytest.raises(ValueError, match="not one of"):
        contention.measure(clock="thread")


def test_contention_given_as_two_factors_is_decode_then_extend():
    f = load_script("experiments/sim_fidelity/run.py")
    assert f.given_factors("1.24,1.0") == (1.24, 1.0) and f.given_factors("1.1") == (1.1, 1.1)
    for bad in ("fast", "1,2,3", "0", "-1,1"):
        with pytest.raises(SystemExit, match="decode,extend"):
            f.given_factors(bad)
