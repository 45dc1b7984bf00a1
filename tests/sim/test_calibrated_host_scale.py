"""sim.cost.host_scale: every priced second of the calibrated model (steps, fast-forwarded decode runs and the HTTP
worker's serving CPU) times the host's slowness against its profile; 1.0 by default. The calibration's reference
speed (experiments/calibrate/run.py normalize) and the pinned probe it is taken with."""
import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step
from framework.core.registry import COST
from framework.runs.sim import cost_instance
from script_loader import load_script


def _cost(**kw):
    cfg = COST.get("calibrated").Config(between="grid", point="median", serving="measured", **kw)
    return COST.build("calibrated", cfg, cost_instance(compose(["logger.mode=disabled"])))


def test_host_scale_multiplies_every_priced_second_and_one_is_the_default():
    plain, slow = _cost(), _cost(host_scale=1.37)
    assert COST.get("calibrated").Config().host_scale == 1.0
    steps = [Step(batches=(BatchShape("extend", (300, 40), (128, 0)),)),
             Step(batches=(BatchShape("decode", (1,) * 6, (200,) * 6),))]
    for step in steps:
        assert plain.step_time(step) > 0
        assert slow.step_time(step) == pytest.approx(1.37 * plain.step_time(step))
    run_plain, run_slow = plain.decode_times((6,), (1200,), 5), slow.decode_times((6,), (1200,), 5)
    assert run_slow == pytest.approx([1.37 * t for t in run_plain])
    groups_plain, groups_slow = plain.decode_times((3, 2), (500, 900), 4), slow.decode_times((3, 2), (500, 900), 4)
    assert groups_slow == pytest.approx([1.37 * t for t in groups_plain])            # a run over several groups
    assert run_plain[0] == pytest.approx(plain.step_time(steps[1]))   # a run prices its steps as step_time does
    assert all(s == pytest.approx(1.37 * p) for s, p in zip(slow.serving_host_s(), plain.serving_host_s()))
    assert min(plain.serving_host_s()) > 0


def test_host_scale_extend_scales_the_steps_that_extend_and_host_scale_the_rest():
    plain, apart = _cost(), _cost(host_scale=1.2, host_scale_extend=0.7)
    assert COST.get("calibrated").Config().host_scale_extend is None          # default: host_scale for both
    extend = Step(batches=(BatchShape("extend", (300, 40), (128, 0)),))
    decode = Step(batches=(BatchShape("decode", (1,) * 6, (200,) * 6),))
    assert apart.step_time(extend) == pytest.approx(0.7 * plain.step_time(extend))
    assert apart.step_time(decode) == pytest.approx(1.2 * plain.step_time(decode))
    assert apart.decode_times((6,), (1200,), 3) == pytest.approx([1.2 * t for t in plain.decode_times((6,), (1200,), 3)])
    assert all(s == pytest.approx(1.2 * p) for s, p in zip(apart.serving_host_s(), plain.serving_host_s()))


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_host_scale_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match=r"host_scale=.*must be > 0"):
        _cost(host_scale=bad)
    with pytest.raises(ValueError, match=r"host_scale_extend=.*must be > 0"):
        _cost(host_scale_extend=bad)


def test_calibration_expresses_each_point_at_the_reference_speed_of_the_host():
    calibrate = load_script("experiments/calibrate/run.py")
    _points, normalize = calibrate._points, calibrate.normalize
    # one config: 9 prefill points measured at a speed of 10 ms, then 9 decode points at 20 ms (the host slowed)
    prefill = _points([[[1.0, 2.0, 3.0]] * 9], [{"pinned_s": 0.010, "contention": 1.2}] * 9)
    decode = _points([[[4.0, 4.0, 8.0]] * 9], [{"pinned_s": 0.020, "contention": 1.2}] * 9)
    profiles = {"x": {"prefill": prefill, "decode": decode}}
    assert normalize(profiles, ["x"], apply=False) == pytest.approx(0.015) and "seconds_raw" not in prefill
    assert normalize(profiles, ["x"]) == pytest.approx(0.015)            # the mean of the points' speeds
    # far from the change, a point is scaled by its own speed (its 3 neighbours each side measured alike)
    assert prefill["seconds"][0][0] == pytest.approx(1.0 * 1.5)          # measured fast: counts as slower
    assert prefill["seconds_median"][0][0] == pytest.approx(2.0 * 1.5)
    assert decode["seconds"][0][-1] == pytest.approx(4.0 * 0.75)         # measured slow: counts as faster
    # beside it, by the mean of its neighbourhood: the last prefill point's 7 hold 4 at 10 ms and 3 at 20
    assert prefill["pinned_s_smoothed"][0][-1] == pytest.approx((4 * 0.010 + 3 * 0.020) / 7)
    assert prefill["seconds_raw"][0] == [1.0] * 9 and decode["seconds_median_raw"][0] == [4.0] * 9
    assert "collectives_per_step" not in profiles["x"] and prefill["contention"] == [[1.2] * 9]   # (recorded)


def test_interleaved_prefill_points_keep_their_sweeps_speed_and_are_not_smoothed_into_the_decode_points():
    calibrate = load_script("experiments/calibrate/run.py")
    # prefill points measured together in sweeps (each carries the sweeps' mean, 10 ms), then decode points at 20 ms
    prefill = {**calibrate._points([[[1.0, 2.0, 3.0]] * 4], [{"pinned_s": 0.010}] * 4), "order": "interleaved"}
    decode = calibrate._points([[[4.0, 4.0, 8.0]] * 9], [{"pinned_s": 0.010}] + [{"pinned_s": 0.020}] * 8)
    profiles = {"x": {"prefill": prefill, "decode": decode}}
    ref = calibrate.normalize(profiles, ["x"])
    assert prefill["pinned_s_smoothed"] == [[0.010] * 4]                 # every prefill point alike: ratios kept
    assert prefill["seconds"][0] == pytest.approx([1.0 * ref / 0.010] * 4)    # each its fastest, at the sweeps' speed
    # the decode points are smoothed among themselves: the first one's 4 (itself and 3 after) hold 1 at 10 ms
    assert decode["pinned_s_smoothed"][0][0] == pytest.approx((0.010 + 3 * 0.020) / 4)


def test_a_config_of_several_ranks_has_its_waits_on_collectives_split_off_before_rescaling():
    calibrate = load_script("experiments/calibrate/run.py")
    host = {"pinned_s": 0.010, "contention": 1.2, "collective_s": 0.002, "collectives_per_step": 12.0}
    # two ranks: 9 prefill points of 0.030 / 0.040 s, each step waiting on 12 collectives of 2 ms; 9 decode points
    # measured while the host ran at half the speed: 0.024 s
    prefill = calibrate._points([[[0.030, 0.040, 0.050]] * 9], [host] * 9)
    decode = calibrate._points([[[0.036, 0.036, 0.040]] * 9], [{**host, "pinned_s": 0.020}] * 9)
    two = {"prefill": prefill, "decode": decode}
    assert calibrate.normalize({"tp": two}, ["tp"]) == pytest.approx(0.015)
    assert two["collectives_per_step"] == {"prefill": 12.0, "decode": 12.0} and two["collective_s"] == \
        pytest.approx(0.002)
    assert prefill["seconds"][0][0] == pytest.approx((0.030 - 0.024) * 1.5)           # the compute, rescaled
    assert prefill["seconds_median"][0][0] == pytest.approx((0.040 - 0.024) * 1.5)
    assert decode["seconds"][0][-1] == pytest.approx((0.036 - 0.024) * 0.75)
    assert prefill["wait_s"][0][0] == pytest.approx(0.024) and prefill["seconds_raw"][0][0] == 0.030
    # a point whose waits seem to take it all keeps a floor of compute
    short = calibrate._points([[[0.020]] * 9], [host] * 9)
    calibrate.normalize({"tp": {"prefill": short, "decode": calibrate._points([[[0.030]] * 9], [host] * 9)}}, ["tp"])
    assert short["seconds"][0][0] == pytest.approx(calibrate.WAIT_FLOOR * 0.020)


def test_a_split_profile_prices_its_waits_at_the_hosts_collective_latency(tmp_path):
    import json
    from framework.core.paths import REPO_ROOT
    from plugins.cost.calibrated import DEFAULT_PATH
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    prof = data["profiles"]["tpx2/triton_fused"]
    prof["collectives_per_step"], prof["collective_s"] = {"prefill": 14.0, "decode": 12.0}, 0.002
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    tp = compose(["logger.mode=disabled", "parallel=tp", "parallel.size=2", "moe=triton_fused"])
    shape = cost_instance(tp)

    def cost(**kw):
        cfg = COST.get("calibrated").Config(path=str(path), between="grid", point="median", **kw)
        return COST.build("calibrated", cfg, shape)
    own, slow, scaled = cost(), cost(collective_s=0.005), cost(host_scale=2.0)
    step = Step(batches=(BatchShape("decode", (1,) * 4, (200,) * 4),))
    assert slow.step_time(step) == pytest.approx(own.step_time(step) + 12 * 0.003)     # the waits at 5 ms, not 2
    assert scaled.step_time(step) == pytest.approx(2 * own.step_time(step) - 12 * 0.002)   # the compute only scales
    whole = cost(host_scale=2.0, host_scale_waits=True)           # sim.cost.host_scale_waits: the waits too
    assert whole.step_time(step) == pytest.approx(2 * own.step_time(step))
    assert cost(host_scale_waits=True).step_time(step) == pytest.approx(own.step_time(step))   # at 1: the same
    measured = cost(host_scale=2.0, host_scale_waits=True, collective_s=0.002)   # the host's own latency: unscaled
    assert measured.step_time(step) == pytest.approx(scaled.step_time(step))
    assert slow.decode_times((4,), (800,), 3)[0] == pytest.approx(slow.step_time(step))   # a run: the same
    extend = Step(batches=(BatchShape("extend", (300,), (128,)),))
    assert slow.step_time(extend) == pytest.approx(own.step_time(extend) + 14 * 0.003)    # an extend step's own count
    with pytest.raises(ValueError, match=r"collective_s=0.0 must be > 0"):
        cost(collective_s=0.0)


def test_a_pinned_probe_takes_each_core_in_turn_and_gives_the_thread_its_cores_back():
    import os
    from framework.core.host_probe import pinned
    cpus = os.sched_getaffinity(0)
    assert pinned(0.02) > 0
    assert os.sched_getaffinity(0) == cpus


def test_what_a_new_profile_keeps_is_moved_to_its_reference_speed(capsys):
    calibrate = load_script("experiments/calibrate/run.py")
    kept = {"old": {"prefill": {"seconds": [[1.0]], "seconds_median": [[2.0]]}, "decode": {"seconds": [[4.0]]}}}
    serving = {"request_cpu_s": 0.002, "token_cpu_s": 0.0004, "normalized_to_pinned_s": 0.010}
    moved = calibrate.rebase(kept, {"old"}, serving, {"normalized": "pinned", "pinned_s": 0.010}, 0.015)
    assert kept["old"]["prefill"]["seconds_median"][0][0] == pytest.approx(3.0)
    assert kept["old"]["decode"]["seconds"][0][0] == pytest.approx(6.0)
    assert moved["request_cpu_s"] == pytest.approx(0.003) and moved["normalized_to_pinned_s"] == 0.015
    assert calibrate.rebase({}, set(), serving, {"normalized": "none", "probe_s": 0.01}, 0.015) is None
    assert "re-measure it with experiments/calibrate/serving.py" in capsys.readouterr().out


def test_a_profiles_reference_speed_is_read_only_where_its_points_were_normalized_to_it():
    from plugins.cost.calibrated import reference_pinned_s
    assert reference_pinned_s({"pinned_s": 0.012, "normalized": "pinned"}) == 0.012
    assert reference_pinned_s({"pinned_s": 0.012}) is None          # stamped, but its seconds are as measured
    assert reference_pinned_s(None) is None                          # no stamp at all
