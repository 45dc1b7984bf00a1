"""The summary metrics against their definitions (SGLang bench_serving / vLLM benchmark_serving), computed by brute
force over hand-made records; requests.jsonl round trip."""
from __future__ import annotations

import math
import random

import pytest

from framework.core.records import RequestRecord, read_requests, write_requests
from framework.report.metrics import summarize
from framework.contracts.workload import SloConfig


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), written out."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def records(n: int = 40, seed: int = 0) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out_tokens = rng.choice([1, 2, 5, 17])
        ttft = rng.uniform(0.01, 0.5)
        itl = [rng.uniform(0.001, 0.05) for _ in range(out_tokens - 1)]
        out.append(RequestRecord(ok=True, prompt_tokens=rng.randint(10, 300), completion_tokens=out_tokens,
                                 cached_tokens=rng.randint(0, 9), ttft_s=ttft, e2e_s=ttft + sum(itl), itl_s=itl,
                                 send_s=i * 0.1, session=f"s{i}", worker=f"w{i % 3}"))
    out.append(RequestRecord(ok=False, error="HTTP 400: too long", send_s=9.0))
    return out


def test_summary_matches_the_definitions():
    recs, duration = records(), 7.5
    ok = [r for r in recs if r.ok]
    s = summarize(recs, duration)
    assert (s["requests_completed"], s["requests_failed"]) == (len(ok), 1)
    prompt, output = sum(r.prompt_tokens for r in ok), sum(r.completion_tokens for r in ok)
    assert s["request_throughput_req_s"] == pytest.approx(len(ok) / duration)
    assert s["input_throughput_tok_s"] == pytest.approx(prompt / duration)
    assert s["output_throughput_tok_s"] == pytest.approx(output / duration)
    assert s["total_throughput_tok_s"] == pytest.approx((prompt + output) / duration)
    assert s["mean_concurrency"] == pytest.approx(sum(r.e2e_s for r in ok) / duration)
    assert s["cache_hit_rate"] == pytest.approx(sum(r.cached_tokens for r in ok) / prompt)
    series = {"ttft": [r.ttft_s for r in ok], "e2e": [r.e2e_s for r in ok],
              "tpot": [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1],
              "itl": [g for r in ok for g in r.itl_s]}              # every gap of every request, pooled
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        assert s[f"{name}_mean_ms"] == pytest.approx(sum(ms) / len(ms))
        for q in (50, 90, 99):
            assert s[f"{name}_p{q}_ms"] == pytest.approx(percentile(ms, q))


def test_goodput_counts_requests_within_every_slo():
    recs, duration = records(), 5.0
    slo = SloConfig(ttft_ms=200, tpot_ms=20)
    ok = [r for r in recs if r.ok]
    good = [r for r in ok if r.ttft_s * 1e3 <= 200 and (r.completion_tokens < 2 or r.tpot_s * 1e3 <= 20)]
    assert 0 < len(good) < len(ok)                                  # the SLOs bite, but not on everything
    s = summarize(recs, duration, slo)
    assert s["goodput_req_s"] == pytest.approx(len(good) / duration)
    assert s["slo_attainment"] == pytest.approx(len(good) / len(ok))
    assert summarize(recs, duration)["goodput_req_s"] == pytest.approx(len(ok) / duration)   # no SLO: all good
    e2e = SloConfig(e2e_ms=300)
    assert summarize(recs, duration, e2e)["goodput_req_s"] == pytest.approx(
        sum(r.e2e_s <= 0.3 for r in ok) / duration)


def test_empty_and_all_failed_runs_do_not_divide_by_zero():
    s = summarize([RequestRecord(ok=False, error="x")], 1.0)
    assert s["requests_completed"] == 0 and s["cache_hit_rate"] == 0.0 and math.isnan(s["ttft_p50_ms"])


def test_requests_jsonl_round_trip(tmp_path):
    recs = records(8)
    path = write_requests(recs, tmp_path / "requests.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(recs)
    back = read_requests(path)
    assert back == sorted(recs, key=lambda r: r.send_s)              # in the order they were sent
