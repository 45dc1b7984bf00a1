"""experiments/pd_splitwise/predict.py --round 2: Splitwise's own routers per system, a token machine's KV capacity
from splitwise-sim's own figures, and the router's reasons logged (a few requests: no rate is searched here)."""
from __future__ import annotations

import pytest


def test_round_two_routes_each_system_by_its_splitwise_scheduler(predict):
    assert predict.ROUTERS_ROUND2 == {"baseline": "token_jsq", "splitwise": "mixed_pool"}
    assert predict.KV_BYTES == 4014080                          # BLOOM-176B's KV a token, as round 1 states it
    (cap,) = [o for o in predict.overrides("mixed_pool") if o.startswith("router.kv_capacity_tokens=")]
    assert float(cap.split("=")[1]) == pytest.approx((8 * 85899345920 - 329e9) / 4014080)
    assert not [o for o in predict.overrides("token_jsq") if "kv_capacity" in o]
    assert "kv_cost" not in predict.SETUP_ROUND2["routing"] and predict.SETUP_ROUND2["model"] == predict.SETUP["model"]
    assert not any("kv_cost" in d for d in predict.DEVIATIONS_ROUND2)


def test_a_round_two_run_logs_the_router_s_reasons(predict):
    reasons = {}
    records = predict.run("splitwise", 10.0, 5, 4.0, 0, "mixed_pool", reasons)
    assert records and all(r.ok for r in records)
    # every request: one prompt-machine decision and one token-machine decision
    assert sum(reasons.get(k, 0) for k in ("least_pending_prompt", "prompt_queue_long")) == len(records)
    assert sum(reasons.get(k, 0) for k in ("least_memory", "token_memory_full")) == len(records)
