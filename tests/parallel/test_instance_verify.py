"""Multi-rank instances (gloo) against the single-process reference: every rank's logits, the instance protocol
(lockstep, IDLE batches, can_run_graph), KV accounting, and every token layout of the MoE contract."""
from functools import lru_cache

import pytest

from framework.registry import MOE
from framework.verify import engine_cases, verify_instance
from parallel_helpers import make_cfg

ATOL = 1e-4   # verify.atol for fp32


@lru_cache(maxsize=None)
def verified(parallel: str, size: int) -> dict:
    """Every case of mode=verify plus one per MoE token layout, on one spawned instance."""
    cfg = make_cfg(f"parallel={parallel}", f"parallel.size={size}")
    ep = MOE.get("ep").Config
    cases = {name: (engine_cfg, cfg.moe) for name, engine_cfg in engine_cases(cfg).items()}
    cases.update({
        "moe_ep_all_to_all": (cfg.engine, ep(dispatch="all_to_all")),     # layout "local": no gather under DP
        "moe_ep_all_reduce": (cfg.engine, ep(dispatch="all_reduce")),     # layout "all", partial: reduce
        "moe_triton_fused": (cfg.engine, MOE.get("triton_fused").Config()),   # "all", partial, shared sliced
    })
    return verify_instance(cfg, cases)


@pytest.mark.parametrize("parallel,size", [("tp", 2), ("dp_attn", 2),
                                           pytest.param("tp", 4, marks=pytest.mark.slow),
                                           pytest.param("dp_attn", 4, marks=pytest.mark.slow)])
def test_every_rank_matches_the_reference(parallel, size):
    results = verified(parallel, size)
    for name, case in results.items():
        assert case["problems"] == [], (name, case["problems"])
        assert case["max_abs_err"] <= ATOL, (name, case["max_abs_err"])
        assert case["requests"] == 12
    assert results["radix_cache"]["cached_tokens"] > 0          # the second round hit the per-rank radix caches
    assert results["tight_kv_retract"]["retractions"] > 0       # and retraction + resume ran on a rank


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dp_attention_runs_idle_batches_and_counts_graph_eligible_steps(size):
    results = verified("dp_attn", size)
    pinned = results["chunked_prefill"]              # rank size-1 gets no request at all, the others uneven loads
    assert pinned["requests_per_rank"][-1] == 0 and sum(pinned["requests_per_rank"]) == 12
    assert pinned["idle_steps"] >= pinned["steps"]   # the empty rank ran an IDLE batch at every step
    assert 0 < pinned["graph_eligible_steps"] < pinned["steps"]   # decode/idle steps yes, steps with an extend no
    spread = results["radix_cache"]["requests_per_rank"]          # the controller's round robin
    assert spread == [12 // size] * size


def test_kv_accounting_dp_attention_holds_size_times_the_tokens_of_tp():
    tp, dp = verified("tp", 2)["radix_cache"], verified("dp_attn", 2)["radix_cache"]
    assert dp["kv_capacity_tokens_per_rank"] == tp["kv_capacity_tokens_per_rank"]     # the full latent per rank
    assert tp["kv_capacity_tokens_instance"] == tp["kv_capacity_tokens_per_rank"]     # TP: every rank a copy
    assert dp["kv_capacity_tokens_instance"] == 2 * tp["kv_capacity_tokens_instance"]
