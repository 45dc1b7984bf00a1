"""bench_serving's figures (SGLang v0.4's calculate_metrics) under its names, and an experiment's published figures
printed beside a simulated run's."""
from __future__ import annotations

import pytest

from framework.config import compose
from framework.core.errors import UserError
from framework.core.records import RequestRecord
from framework.report.metrics import summarize
from framework.runs.sim import published_figures, published_table, simulate


def test_totals_count_completed_requests_over_the_duration():
    recs = [RequestRecord(ok=True, prompt_tokens=100, completion_tokens=10, ttft_s=0.1, e2e_s=1.0),
            RequestRecord(ok=True, prompt_tokens=300, completion_tokens=30, ttft_s=0.2, e2e_s=3.0),
            RequestRecord(ok=False, prompt_tokens=500, error="boom")]         # a failed request counts nowhere
    b = summarize(recs, 4.0)["bench_serving"]
    assert b == {"duration": 4.0, "completed": 2, "total_input_tokens": 400, "total_output_tokens": 40,
                 "request_throughput": 0.5, "input_throughput": 100.0, "output_throughput": 10.0,
                 "total_throughput": 110.0, "concurrency": 1.0}


BLOG_SMALL = ["experiment=sglang_router_blog", "cluster.instances=2", "workload.num_groups=4",
              "workload.prompts_per_group=4", "workload.system_prompt_len=256", "workload.question_len=16",
              "workload.output_len=8"]


def test_a_simulated_run_carries_them_and_the_published_figures_of_its_case():
    cfg = compose(BLOG_SMALL + ["router=round_robin"])
    results, records = simulate(cfg)
    b = results["bench_serving"]
    assert b["completed"] == len(records) == 16 and b["duration"] == results["duration_s"]
    assert b["total_throughput"] == pytest.approx(sum(r.prompt_tokens + r.completion_tokens for r in records)
                                                  / max(r.send_s + r.e2e_s for r in records))
    pub = published_figures(cfg, results)
    assert pub["case"] == "router.name=round_robin" and set(pub["figures"]) == {"total_throughput_tok_s",
                                                                                "sglang_cache_hit_rate"}
    row = pub["figures"]["total_throughput_tok_s"]
    assert row["published"] == 82665.0 and row["ratio"] == pytest.approx(results["total_throughput_tok_s"] / 82665.0)
    assert "82,665" in published_table(pub)


def test_a_published_case_that_names_no_config_value_is_refused():
    cfg = compose(BLOG_SMALL + ["sim.published.case=router.nope"])
    with pytest.raises(UserError, match="router.nope"):
        published_figures(cfg, {})
