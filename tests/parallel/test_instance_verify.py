"""Multi-rank instances (gloo) against the single-process reference: every rank's logits, the instance protocol
(DP groups, lockstep, IDLE batches, can_run_graph), KV accounting under both sizings, and every token layout of the
MoE contract under both FFN exchanges of DP attention."""
from functools import lru_cache

import pytest

from framework.engine.engine import plan_memory
from framework.core.registry import MOE, PARALLELISM
from framework.runs.verify import engine_cases, verify_instance
from parallel_helpers import make_cfg

ATOL = 1e-4   # verify.atol for fp32
SIZES = {("tp", 2): [], ("dp_attn", 2): [], ("dp_attn_tp", 2): ["parallel.size=2"],    # dp_attn_tp x2: one group
         ("tp", 4): ["parallel.size=4"], ("dp_attn", 4): ["parallel.size=4"], ("dp_attn_tp", 4): []}


@lru_cache(maxsize=None)
def verified(parallel: str, size: int) -> dict:
    """Every case of mode=verify plus one per MoE token layout, on one spawned instance."""
    cfg = make_cfg(f"parallel={parallel}", *SIZES[parallel, size])
    assert cfg.parallel.size == size
    ep = MOE.get("ep").Config
    cases = {name: (engine_cfg, cfg.moe) for name, engine_cfg in engine_cases(cfg).items()}
    cases.update({
        "moe_ep_all_to_all": (cfg.engine, ep(dispatch="all_to_all")),     # layout "local": no gather under DP
        "moe_ep_all_reduce": (cfg.engine, ep(dispatch="all_reduce")),     # layout "all", partial: reduce
        "moe_triton_fused": (cfg.engine, MOE.get("triton_fused").Config()),   # "all", partial, shared sliced
    })
    return verify_instance(cfg, cases)


@pytest.mark.parametrize("parallel,size", [pytest.param("tp", 2, marks=pytest.mark.long), ("dp_attn", 2),
                                           pytest.param("dp_attn_tp", 2, marks=pytest.mark.long),
                                           pytest.param("tp", 4, marks=pytest.mark.slow),
                                           pytest.param("dp_attn", 4, marks=pytest.mark.slow),
                                           pytest.param("dp_attn_tp", 4, marks=pytest.mark.slow)])
def test_every_rank_matches_the_reference(parallel, size):
    results = verified(parallel, size)
    for name, case in results.items():
        assert case["problems"] == [], (name, case["problems"])
        assert case["max_abs_err"] <= ATOL, (name, case["max_abs_err"])
        assert case["requests"] == 12
    assert results["radix_cache"]["cached_tokens"] > 0          # the second round hit the per-group radix caches
    assert results["tight_kv_retract"]["retractions"] > 0       # and retraction + resume ran in a group


@pytest.mark.parametrize("parallel,size", [("dp_attn", 2), pytest.param("dp_attn", 4, marks=pytest.mark.slow),
                                           pytest.param("dp_attn_tp", 4, marks=pytest.mark.slow)])
def test_dp_attention_runs_idle_batches_and_counts_graph_eligible_steps(parallel, size):
    results = verified(parallel, size)
    tp = size // PARALLELISM.get(parallel).dp_size(make_cfg(f"parallel={parallel}", *SIZES[parallel, size]).parallel)
    pinned = results["chunked_prefill"]              # the last DP group gets no request at all, the others uneven
    assert pinned["requests_per_rank"][-tp:] == [0] * tp and sum(pinned["requests_per_rank"]) == 12 * tp
    assert pinned["idle_steps"] >= tp * pinned["steps"]          # its ranks ran an IDLE batch at every step
    assert 0 < pinned["graph_eligible_steps"] < pinned["steps"]   # decode/idle steps yes, steps with an extend no
    spread = results["radix_cache"]["requests_per_rank"]          # the dispatcher's round robin over the groups
    assert spread == [12 * tp // size] * size


@pytest.mark.long
def test_kv_accounting_under_both_sizings():
    """engine.mem_budget_mb (the default): the KV pool is what a rank's budget leaves after its weights, so DP
    attention, which keeps attention, embedding and lm_head whole, has fewer tokens per rank than TP. With
    engine.kv_budget_mb (tight_kv_retract sets it) every rank holds the same tokens: TP's instance holds one rank's
    worth (every rank a copy), DP attention's size times as many."""
    tp, dp = verified("tp", 2), verified("dp_attn", 2)
    for parallel, res in (("tp", tp), ("dp_attn", dp)):
        cfg = make_cfg(f"parallel={parallel}")
        plan = plan_memory(cfg.model, cfg.engine, PARALLELISM.get(parallel), cfg.parallel, MOE.get(cfg.moe.name),
                           cfg.moe)
        assert plan.sizing == "mem_budget"
        expect = (int(cfg.engine.mem_budget_mb * 2**20) - plan.weight_bytes_total) // cfg.model.kv_bytes_per_token()
        assert res["radix_cache"]["kv_capacity_tokens_per_rank"] == plan.kv_tokens == expect
    assert dp["radix_cache"]["kv_capacity_tokens_per_rank"] < tp["radix_cache"]["kv_capacity_tokens_per_rank"]
    assert tp["radix_cache"]["kv_capacity_tokens_instance"] == tp["radix_cache"]["kv_capacity_tokens_per_rank"]
    assert dp["radix_cache"]["kv_capacity_tokens_instance"] == 2 * dp["radix_cache"]["kv_capacity_tokens_per_rank"]
    tight_tp, tight_dp = tp["tight_kv_retract"], dp["tight_kv_retract"]
    cfg = make_cfg("parallel=tp")
    tight_tokens = int(engine_cases(cfg)["tight_kv_retract"].kv_budget_mb * 2**20) // cfg.model.kv_bytes_per_token()
    assert tight_tp["kv_capacity_tokens_per_rank"] == tight_dp["kv_capacity_tokens_per_rank"] == tight_tokens
    assert tight_dp["kv_capacity_tokens_instance"] == 2 * tight_tp["kv_capacity_tokens_instance"]


@pytest.mark.long
def test_dp_attention_reduce_scatter_switch_matches_the_reference():
    """parallel.ffn_comm=reduce_scatter (servelab's) against the reference, with every MoE layout's partiality."""
    cfg = make_cfg("parallel=dp_attn", "parallel.ffn_comm=reduce_scatter", "verify.max_new_tokens=3")
    cases = {f"moe_{name}": (engine_cases(cfg)["chunked_prefill"], moe) for name, moe in {
        "reference": cfg.moe, "triton_fused": MOE.get("triton_fused").Config(),
        "ep_all_reduce": MOE.get("ep").Config(dispatch="all_reduce")}.items()}
    for name, case in verify_instance(cfg, cases).items():
        assert case["problems"] == [] and case["max_abs_err"] <= ATOL, (name, case)
