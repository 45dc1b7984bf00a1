"""mode=sim hands the simulated radix caches' KV events and the instances' load reports to the policies that follow
them: precise_prefix's view (events only: no credits for requests in flight) estimates the simulated hit rate, and
routes far better than round robin."""
from __future__ import annotations

import pytest

from framework.config import compose
from framework.runs.sim import simulate

BASE = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "cluster.instances=4", "engine.kv_budget_mb=6",
        "cluster.kv_block_size=4"]
WORKLOADS = {
    "shared_prefix": ["workload=shared_prefix", "workload.num_groups=8", "workload.prompts_per_group=6",
                      "workload.system_prompt_len=512", "workload.question_len=32", "workload.output_len=8",
                      "workload.max_concurrency=8"],
    "multi_turn": ["workload=multi_turn", "workload.num_conversations=12", "workload.turns=4",
                   "workload.output_len=16", "workload.max_concurrency=8"],
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_precise_prefix_follows_the_simulated_caches(workload):
    exact, _ = simulate(compose(BASE + WORKLOADS[workload] + ["router=precise_prefix", "router.block_size=4"]))
    events_only, _ = simulate(compose(BASE + WORKLOADS[workload] + ["router=precise_prefix", "router.block_size=4",
                                                                    "router.pending_credit=false"]))
    rr, _ = simulate(compose(BASE + WORKLOADS[workload] + ["router=round_robin"]))
    assert exact["requests_completed"] == rr["requests_completed"] == 48
    # without credits for requests in flight the view is the events' alone: it still finds the cached prefixes
    assert events_only["cache_hit_rate"] > rr["cache_hit_rate"] + 0.2
    assert events_only["router_estimated_hit_rate"] > 0.5 * events_only["cache_hit_rate"]
    assert abs(exact["router_estimated_hit_rate"] - exact["cache_hit_rate"]) < 0.01
    assert exact["cache_hit_rate"] > rr["cache_hit_rate"] + 0.2


def test_block_sizes_must_agree():
    with pytest.raises(ValueError, match="router.block_size=16 but the workers publish blocks of "
                                         "cluster.kv_block_size=4"):
        simulate(compose(BASE + WORKLOADS["multi_turn"] + ["router=precise_prefix"]))


def test_load_reports_reach_power_of_two():
    """power_of_two(load=worker_tokens) decides on the polled reports: with a poll interval longer than the run it
    sees none (all zero: ties) and routes otherwise than with a poll every 20 ms (the default 0.5 s is about this
    short run's length on the calibrated CPU profile, so it would test the profile, not the reports)."""
    polled = simulate(compose(BASE + WORKLOADS["multi_turn"] + ["router=power_of_two", "router.load=worker_tokens",
                                                                "router.load_poll_interval_s=0.02"]))
    blind = simulate(compose(BASE + WORKLOADS["multi_turn"] + ["router=power_of_two", "router.load=worker_tokens",
                                                               "router.load_poll_interval_s=1e9"]))
    workers = lambda recs: [r.worker for r in sorted(recs, key=lambda r: (r.session, r.turn))]  # noqa: E731
    assert workers(polled[1]) != workers(blind[1])
