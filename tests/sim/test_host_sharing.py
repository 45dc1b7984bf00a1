"""The simulated CPU host (sim.host_cores): fair sharing never does more work than the cores can, and changes
nothing while the cores are not oversubscribed; an HTTP worker's serving CPU (sim.cost.serving=measured) runs in
series with its steps."""
import json

import pytest

from framework.config import compose
from framework.core.paths import REPO_ROOT
from framework.runs.sim import simulate
from plugins.cost.calibrated import DEFAULT_PATH

BUSY = ["mode=sim", "sim.cost=calibrated", "logger.mode=disabled", "cluster.instances=4", "workload=random",
        "workload.num_prompts=48", "workload.input_len=512", "workload.output_len=8", "workload.max_concurrency=12",
        "sim.host_side_procs=0"]


def _records(results_records):
    return [r.__dict__ for r in results_records[1]]


def test_fair_sharing_does_no_more_work_than_the_cores():
    for cores in (1, 2):
        results, _ = simulate(compose(BUSY + [f"sim.host_cores={cores}", "sim.host_sharing=fair"]))
        work = results["extend_cpu_s"] + results["decode_cpu_s"]      # the priced seconds of every step
        assert work <= cores * results["duration_s"] * (1 + 1e-9)
        assert work >= 0.9 * cores * results["duration_s"]               # and the cores stay busy: 12 clients, 4 ranks


def test_fair_sharing_changes_nothing_while_the_cores_suffice():
    fair = simulate(compose(BUSY + ["sim.host_cores=64", "sim.host_sharing=fair"]))
    at_start = simulate(compose(BUSY + ["sim.host_cores=64"]))
    assert _records(fair) == _records(at_start)


def test_an_unknown_host_sharing_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"host_sharing='even'.*\('at_start', 'fair'\)"):
        simulate(compose(BUSY + ["sim.host_cores=2", "sim.host_sharing=even"]))


def _profile_with_serving(tmp_path, per_request: float, per_token: float):
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    data["serving"] = {"request_cpu_s": per_request, "token_cpu_s": per_token,      # at the profile's reference speed
                       "normalized_to_pinned_s": data["host_probe"].get("pinned_s")}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    return path


ONE_BY_ONE = ["mode=sim", "sim.cost=calibrated", "logger.mode=disabled", "cluster.instances=1", "workload=random",
              "workload.num_prompts=6", "workload.input_len=64", "workload.output_len=4", "workload.max_concurrency=1",
              "workload.range_ratio=1"]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_serving_cpu_runs_in_series_with_the_steps(tmp_path, fast_forward):
    """One request at a time on one HTTP worker: its first token comes its per-request work and one token's later
    (the step after its arrival carries the first, the step that samples it the second), its last token its
    per-request work and all its tokens' later; in-process (no HTTP worker) nothing changes."""
    path = _profile_with_serving(tmp_path, 0.004, 0.0005)
    base = ONE_BY_ONE + [f"sim.cost.path={path}", f"sim.fast_forward={str(fast_forward).lower()}"]
    off, on = (simulate(compose(base + [f"sim.cost.serving={v}"]))[1] for v in ("none", "measured"))
    assert len(off) == len(on) == 6
    for a, b in zip(off, on):
        assert b.completion_tokens == 4
        assert b.ttft_s - a.ttft_s == pytest.approx(0.004 + 0.0005)
        assert b.e2e_s - a.e2e_s == pytest.approx(0.004 + 0.0005 * 4)
    local = [simulate(compose(base + ["cluster.http=false", f"sim.cost.serving={v}"]))[1] for v in ("none", "measured")]
    assert [r.ttft_s for r in local[0]] == [r.ttft_s for r in local[1]]


def test_serving_work_waits_for_no_run_of_decode_steps(tmp_path):
    """Requests that queue behind a full batch: their serving work lands in the step after their arrival whether
    decode steps advance one at a time or in runs (the very records)."""
    path = _profile_with_serving(tmp_path, 0.004, 0.0005)
    base = ["mode=sim", "sim.cost=calibrated", "logger.mode=disabled", "cluster.instances=1", "workload=random",
            "workload.num_prompts=24", "workload.input_len=64", "workload.output_len=16", "workload.max_concurrency=0",
            "workload.request_rate=30", "engine.max_running_requests=2", f"sim.cost.path={path}",
            "sim.cost.serving=measured", "sim.host_cores=2"]
    fast, slow = (simulate(compose(base + [f"sim.fast_forward={v}"]))[1] for v in ("true", "false"))
    assert [r.__dict__ for r in fast] == [r.__dict__ for r in slow]


def test_serving_without_a_measurement_says_how_to_measure_it(tmp_path):
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    data.pop("serving", None)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"serving=measured.*experiments/calibrate/serving.py"):
        simulate(compose(ONE_BY_ONE + [f"sim.cost.path={path}", "sim.cost.serving=measured"]))


EXACT = ONE_BY_ONE + ["sim.host_cores=2", "sim.network_latency_s=0", "sim.router_overhead_s=0", "sim.host_side_procs=0"]


def _latencies(overrides):
    return [r.e2e_s for r in simulate(compose(overrides))[1]]


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
def test_contention_slows_a_rank_priced_alone_by_its_factor_once_every_core_is_busy(sharing):
    """One request at a time on a one-rank instance, beside one busy process of other work on 2 cores: every step
    runs at 1/c of its price (both cores busy); with the other core idle, or c = 1, nothing changes."""
    base = EXACT + [f"sim.host_sharing={sharing}"]
    plain = _latencies(base + ["sim.host_background=1"])
    slowed = _latencies(base + ["sim.host_background=1", "sim.host_contention=1.5"])
    assert slowed == pytest.approx([1.5 * t for t in plain])
    assert _latencies(base + ["sim.host_contention=1.5"]) == _latencies(base)           # the other core idle
    halfway = _latencies(base + ["sim.host_background=0.5", "sim.host_contention=1.5"])  # 1.5 cores busy: 1.25x
    assert halfway == pytest.approx([1.25 * t for t in _latencies(base + ["sim.host_background=0.5"])])


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
def test_a_contention_measured_with_more_busy_processes_than_cores_grows_up_to_them(sharing):
    """sim.host_contention_busy=4 (the factor measured with 4 busy processes on 2 cores): with 2 busy a step slows by
    1 + 0.5 / 3 of the factor's 0.5, with 4 (and 5) by all of it, on top of the cores' sharing; below 1 is refused."""
    base = EXACT + [f"sim.host_sharing={sharing}"]
    for background, factor in ((1, 1 + 0.5 / 3), (3, 1.5), (4, 1.5)):
        plain = _latencies(base + [f"sim.host_background={background}"])
        slowed = _latencies(base + [f"sim.host_background={background}", "sim.host_contention=1.5",
                                    "sim.host_contention_busy=4"])
        assert slowed == pytest.approx([factor * t for t in plain])
    with pytest.raises(ValueError, match=r"host_contention_busy=0.5 must be >= 1"):
        simulate(compose(base + ["sim.host_contention=1.5", "sim.host_contention_busy=0.5"]))
    # between 1 and 2 busy processes the factor still grows (at 1.5: in full from 1.5 busy)
    half = _latencies(base + ["sim.host_background=1", "sim.host_contention=1.5", "sim.host_contention_busy=1.5"])
    assert half == pytest.approx([1.5 * t for t in _latencies(base + ["sim.host_background=1"])])


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
def test_a_two_rank_instance_keeps_its_priced_contention_and_slows_past_it_under_a_busier_anchor(sharing):
    """Priced with its 2 ranks busy, a two-rank instance holds slowdown(c, 2, b) already: with b = 4 it runs as priced
    alone on 2 cores, and beside 2 busy processes of other work (4 busy) slower by 1.5 / (1 + 0.5 / 3), on top of the
    cores' sharing."""
    tp = EXACT + ["parallel=tp", "parallel.size=2", "moe=triton_fused", "cluster.http=false",
                  f"sim.host_sharing={sharing}"]
    anchored = ["sim.host_contention=1.5", "sim.host_contention_busy=4"]
    assert _latencies(tp + anchored) == pytest.approx(_latencies(tp))
    plain = _latencies(tp + ["sim.host_background=2"])
    assert _latencies(tp + ["sim.host_background=2"] + anchored) == pytest.approx(
        [1.5 / (1 + 0.5 / 3) * t for t in plain])


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
@pytest.mark.parametrize("background", [0, 1])
def test_contention_leaves_an_instance_priced_with_its_ranks_on_every_core_as_priced(sharing, background):
    """A two-rank instance on 2 cores was profiled with both busy: its steps already hold the contention (beside a
    busy process of other work too: the cores are then shared, not slower)."""
    tp = EXACT + ["parallel=tp", "parallel.size=2", "moe=triton_fused", "cluster.http=false",
                  f"sim.host_sharing={sharing}", f"sim.host_background={background}"]
    assert _latencies(tp + ["sim.host_contention=1.5"]) == pytest.approx(_latencies(tp))


def test_a_two_rank_step_re_timed_mid_step_keeps_its_priced_contention():
    """Two two-rank instances on 2 cores: the sharing changes in the middle of one's steps as the other starts and
    stops (fair sharing re-times them), and both still run at their priced contention."""
    tp = EXACT + ["parallel=tp", "parallel.size=2", "moe=triton_fused", "sim.host_sharing=fair", "cluster.instances=2",
                  "workload.max_concurrency=3", "router=round_robin"]
    assert _latencies(tp + ["sim.host_contention=1.5"]) == pytest.approx(_latencies(tp))


def test_a_contention_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match=r"host_contention=0.0 must be > 0"):
        simulate(compose(EXACT + ["sim.host_contention=0"]))


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
def test_extend_steps_take_their_own_contention(sharing):
    """host_contention_extend: steps that extend slow by their own factor, decode steps by host_contention's. One
    request at a time beside one busy process on 2 cores: its first token (the extend step) at 1.2x, the rest of it
    (decode steps) at 1.5x."""
    base = EXACT + [f"sim.host_sharing={sharing}", "sim.host_background=1"]
    plain = simulate(compose(base))[1]
    split = simulate(compose(base + ["sim.host_contention=1.5", "sim.host_contention_extend=1.2"]))[1]
    for p, s in zip(plain, split):
        assert s.ttft_s == pytest.approx(1.2 * p.ttft_s)
        assert s.e2e_s - s.ttft_s == pytest.approx(1.5 * (p.e2e_s - p.ttft_s))
    with pytest.raises(ValueError, match=r"host_contention_extend=-1.0 must be > 0"):
        simulate(compose(base + ["sim.host_contention_extend=-1"]))


def test_a_serving_measurement_at_another_reference_speed_is_refused(tmp_path):
    path = _profile_with_serving(tmp_path, 0.004, 0.0005)
    data = json.loads(path.read_text())
    data["serving"]["normalized_to_pinned_s"] = data["host_probe"]["pinned_s"] * 1.5    # kept from an older profile
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"not at its profile's reference speed.*experiments/calibrate/serving.py"):
        simulate(compose(ONE_BY_ONE + [f"sim.cost.path={path}", "sim.cost.serving=measured"]))


@pytest.mark.parametrize("sharing", ["at_start", "fair"])
def test_steal_stalls_an_instance_while_any_of_its_cores_is_taken(sharing):
    """sim.host_steal: a quarter of each core's time given to other guests. One request at a time: a one-rank
    instance runs at 3/4 of its price, a two-rank one (its ranks meet at every collective) at (3/4)^2, where the same
    steal counted as half a busy process slows it only by 1.25x (fair sharing of 2.5 processes on 2 cores)."""
    one = EXACT + [f"sim.host_sharing={sharing}"]
    assert _latencies(one + ["sim.host_steal=0.5"]) == pytest.approx([t / 0.75 for t in _latencies(one)])
    two = one + ["parallel=tp", "parallel.size=2", "moe=triton_fused", "cluster.http=false"]
    plain = _latencies(two)
    assert _latencies(two + ["sim.host_steal=0.5"]) == pytest.approx([t / 0.75 ** 2 for t in plain])
    assert _latencies(two + ["sim.host_background=0.5"]) == pytest.approx([t * 1.25 for t in plain])


def test_a_steal_outside_the_cores_is_refused():
    for steal in (-0.1, 2):
        with pytest.raises(ValueError, match=r"host_steal=.* must be >= 0 and below sim.host_cores=2"):
            simulate(compose(ONE_BY_ONE + ["sim.host_cores=2", f"sim.host_steal={steal}"]))
    with pytest.raises(ValueError, match=r"host_steal=0.5 needs sim.host_cores > 0"):
        simulate(compose(ONE_BY_ONE + ["sim.host_steal=0.5"]))


def test_steal_on_a_saturated_host_leaves_the_others_the_cores_it_does_not_take():
    """Three busy processes of other work beside a one-rank instance on 2 cores: it gets 2/4 of a core, and with
    half a core stolen (2 - 0.5)/4 (the hypervisor takes its share first), not 2/4.5 as a fifth of a process would."""
    base = EXACT + ["sim.host_sharing=fair", "sim.host_background=3"]
    plain = _latencies(base)
    assert _latencies(base + ["sim.host_steal=0.5"]) == pytest.approx([t * 2 / 1.5 for t in plain])
