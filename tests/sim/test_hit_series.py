"""SGLang v0.4's cache hit rate (Scheduler.log_prefill_stats' tree_cache_metrics): the scheduler's counters against
an independent count from its own step log, the sampled series, and the run-level figures a simulation reports."""
from __future__ import annotations

import random

import pytest

from framework.config import compose
from framework.engine.config import EngineConfig
from framework.engine.kv_pool import CountingKVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler
from framework.engine.stats import HitRateLog, crossing_time
from framework.runs.sim import simulate


def _requests(seed: int) -> list[tuple[int, Req]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(60)]
    return sorted([(rng.randrange(60), Req(shared[:rng.randrange(61)] + [rng.randrange(256) for _ in
                                                                          range(rng.randrange(1, 50))],
                                           SamplingParams(max_new_tokens=rng.randrange(1, 40), ignore_eos=True),
                                           rid=f"r{i}")) for i in range(40)], key=lambda a: a[0])


def _drive(sched: Scheduler, arrivals) -> list[float]:
    pending, step, extend_ends = list(arrivals), 0, []
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        batch = sched.next_batch()
        if batch is not None:
            sched.process(batch, [7 for s in batch.sample if s], float(step))
            if batch.mode.is_extend():
                extend_ends.append(float(step))
        step += 1
        assert step < 5000
    return extend_ends


def _expected(log) -> tuple[int, int]:
    """SGLang's counts from the step log: a request's first (or post-retraction) prefill counts its cached prefix as
    hit, a later chunk of the same prefill counts none; every extended token counts as input."""
    hit = total = 0
    open_prefill: set[str] = set()
    for rec in log:
        if rec.mode == "extend":
            for rid, prefix, n in zip(rec.rids, rec.prefix_lens, rec.extend_lens):
                h = 0 if rid in open_prefill else prefix
                hit, total = hit + h, total + h + n
                open_prefill.add(rid)
        open_prefill -= set(rec.retracted)
    return hit, total


@pytest.mark.parametrize("capacity", [150, 2000])      # tight: chunks, evictions and retractions; roomy: hits
def test_counters_are_sglangs_tree_cache_metrics(capacity):
    sched = Scheduler(EngineConfig(chunked_prefill_tokens=32, init_new_token_ratio=0.1), CountingKVPool(capacity),
                      eos_id=-1, decode_tail=lambda i: "")
    sched.step_log = []
    ends = _drive(sched, _requests(3))
    hit, total = _expected(sched.step_log)
    assert hit > 0 and (sched.stats["cache_hit_tokens"], sched.stats["cache_hit_tokens"]
                        + sched.stats["cache_prefill_tokens"]) == (hit, total)
    if capacity == 150:
        assert sched.stats["retractions"] > 0
    points = sched.hit_log.points            # one per prefill step, at its end, the last one the totals
    assert [p[0] for p in points] == ends and points[-1][1:] == (hit, total)


def test_the_series_stays_bounded_and_in_order():
    stats = {"cache_hit_tokens": 0, "cache_prefill_tokens": 0}
    log = HitRateLog(stats)

    class R:
        prefix_indices, extend_input_len = [0] * 3, 5
    for t in range(5000):
        log.prefill([R()], None)
        log.stamp(float(t))
    times = [p[0] for p in log.points]
    assert len(times) <= HitRateLog.MAX_POINTS and times == sorted(times) and times[-1] > 4000
    assert all(h * 8 == n * 3 for _, h, n in log.points)          # 3 hit of 3 + 5 each time


def test_crossing_time_interpolates_between_samples():
    series = [[0.0, 0.0], [1.0, 0.1], [2.0, 0.5], [3.0, 0.4]]
    assert crossing_time(series, 0.3) == pytest.approx(1.5)
    assert crossing_time(series, 0.0) == 0.0 and crossing_time(series, 0.6) is None


def test_a_simulation_reports_sglangs_hit_rate_per_instance_and_over_time():
    results, _ = simulate(compose(["mode=sim", "workload=shared_prefix", "cluster.instances=2", "router=round_robin",
                                   "logger.mode=disabled", "logger.plots=false"]))
    series = results["sglang_cache_hit_rate_series"]
    assert len(series) == 2 and all(len(inst) == 1 for inst in series)            # one scheduler per instance
    finals = [inst[0][-1][1] for inst in series]
    assert finals == pytest.approx(results["sglang_cache_hit_rate_per_instance"])
    assert all(0 <= t <= results["duration_s"] for inst in series for t, _ in inst[0])
    assert 0 < results["sglang_cache_hit_rate"] < 1
    assert results["sglang_cache_hit_rate_run"] == results["sglang_cache_hit_rate"]     # fresh instances


def test_the_runs_own_rate_leaves_out_what_the_instances_counted_before():
    before = {"kv_sizing": "x", "cache_hit_tokens": 90, "cache_prefill_tokens": 10, "hit_rate_points": [[(1.0, 90, 100)]]}
    after = {**before, "cache_hit_tokens": 100, "cache_prefill_tokens": 90,
             "hit_rate_points": [[(1.0, 90, 100), (5.0, 100, 190)]]}
    from framework.engine.stats import hit_rate_figures
    out = hit_rate_figures([(before, after)], None)
    assert out["sglang_cache_hit_rate"] == pytest.approx(100 / 190)          # SGLang's: since the instance started
    assert out["sglang_cache_hit_rate_run"] == pytest.approx(10 / 90)        # this run's 10 hit of 90
    assert out["sglang_cache_hit_rate_series"] == [[[[-4.0, 0.9], [0.0, pytest.approx(100 / 190)]]]]   # t=0: 1st new
