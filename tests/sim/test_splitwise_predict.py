"""experiments/pd_splitwise/predict.py's yardstick: the trace it replays and Splitwise's SLO arithmetic (no simulation
run: each check is arithmetic on records written here)."""
from __future__ import annotations

import pytest

from framework.core.records import RequestRecord


def test_the_trace_is_the_azure_conversation_sizes_at_the_rate_with_the_same_draws(predict):
    prompts, outputs = predict.trace_sizes()
    assert len(prompts) == len(outputs) == 19366
    slow, fast = predict.requests(2.0, 100.0, 0), predict.requests(4.0, 50.0, 0)
    assert slow == predict.requests(2.0, 100.0, 0)                       # seeded
    assert [(p, o) for _, p, o in slow] == [(p, o) for _, p, o in fast]  # the same draws, twice the clock
    assert [t for t, _, _ in fast] == pytest.approx([t / 2 for t, _, _ in slow])
    assert 150 < len(slow) < 250 and {p for _, p, _ in slow} <= set(prompts) and {o for _, _, o in slow} <= set(outputs)


def test_slowdowns_and_the_nine_slos_as_splitwise_counts_them(predict):
    alone = predict.Alone()
    p, n = 1000, 101
    ttft, tbt = alone.prompt(p), alone.token(p)
    # a P/D request whose first token waited 0.02 s for its KV: Splitwise's TTFT ends with the prompt phase
    r = RequestRecord(ok=True, prompt_tokens=p, completion_tokens=n, ttft_s=2 * ttft + 0.02,
                      e2e_s=2 * ttft + 0.02 + 1.5 * tbt * n, kv_transfer_s=0.02)
    s_ttft, s_tbt, s_e2e = alone.slowdowns(r)
    assert s_ttft == pytest.approx(2.0)
    assert s_tbt == pytest.approx((0.02 + 1.5 * tbt * n) / n / tbt)
    assert s_e2e == pytest.approx(r.e2e_s / (ttft + tbt * (n - 1)))
    assert predict.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert predict.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    at = [RequestRecord(ok=True, prompt_tokens=p, completion_tokens=n, ttft_s=ttft * 1.9, e2e_s=ttft * 1.9 + tbt * n)]
    assert predict.judge(at, alone)["meets_slos"]
    late = [RequestRecord(ok=True, prompt_tokens=p, completion_tokens=n, ttft_s=ttft * 2.0, e2e_s=ttft * 2.0 + tbt * n)]
    assert not predict.judge(late, alone)["meets_slos"]                  # p50 TTFT slowdown must stay below 2
    assert not predict.judge(at + [RequestRecord(ok=False)], alone)["meets_slos"]   # a failed request fails the rate
