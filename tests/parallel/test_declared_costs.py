"""What the plugins declare from shapes alone (for memory sizing and a simulator's costs) is what a built rank holds
and does: per-rank weight bytes against the tensors of the built rank, and each layer's declared collectives against
the ones its forward runs in an extend step (uneven DP loads; at size 4 a DP group with no request runs IDLE)."""
from functools import lru_cache

import pytest

from framework.dist import launch
from framework.engine.engine import plan_memory
from framework.core.registry import MOE, PARALLELISM
from parallel_helpers import make_cfg
from parallel_rank_fns import PROMPT_LENS, declared_vs_real

MOES = {"reference": ["moe=reference"], "triton_fused": ["moe=triton_fused"], "ep": ["moe=ep"],
        "ep_all_reduce": ["moe=ep", "moe.dispatch=all_reduce"]}
SCHEMES = {
    2: {"tp": ["parallel=tp"], "dp_attn": ["parallel=dp_attn"],
        "dp_attn_rs": ["parallel=dp_attn", "parallel.ffn_comm=reduce_scatter"],
        "dp_attn_tp": ["parallel=dp_attn_tp", "parallel.size=2", "parallel.tp_size=2"]},
    4: {"tp_uneven_vocab": ["parallel=tp", "parallel.size=4", "model.vocab_size=262"],
        "dp_attn": ["parallel=dp_attn", "parallel.size=4"],
        "dp_attn_tp": ["parallel=dp_attn_tp"],
        "dp_attn_tp_rs": ["parallel=dp_attn_tp", "parallel.ffn_comm=reduce_scatter"]},
}


def cases(size: int) -> dict:
    out = {}
    for scheme, overrides in SCHEMES[size].items():
        for moe, moe_overrides in MOES.items():
            cfg = make_cfg(*overrides, *moe_overrides)
            out[f"{scheme}/{moe}"] = (cfg.parallel, cfg.moe, cfg.model)
    return out


@lru_cache(maxsize=None)
def measured(size: int) -> list[dict]:
    return launch(declared_vs_real, size, cases(size), backend="gloo", timeout_s=60)


def declared_weights(par_cfg, moe_cfg, model_cfg, rank: int) -> int:
    plugin, moe = PARALLELISM.get(par_cfg.name), MOE.get(moe_cfg.name)
    partial = moe.layout(moe_cfg, par_cfg.size)[1]
    return (sum(plugin.weight_bytes(par_cfg, model_cfg, rank, partial).values())
            + moe.weight_bytes(moe_cfg, model_cfg, rank, par_cfg.size))


def declared_collectives(par_cfg, moe_cfg, model_cfg, rank: int) -> list[tuple]:
    plugin, size = PARALLELISM.get(par_cfg.name), par_cfg.size
    layout, partial = MOE.get(moe_cfg.name).layout(moe_cfg, size)
    groups = [plugin.dp_rank_of(par_cfg, r) for r in range(size)]
    tokens = [sum(PROMPT_LENS[g]) for g in groups]
    out = plugin.edge_comm(par_cfg, model_cfg, tokens, [len(PROMPT_LENS[g]) for g in groups])
    for i in range(model_cfg.num_layers):
        dense = i < model_cfg.first_k_dense_replace
        out += plugin.layer_comm(par_cfg, model_cfg, tokens, "all" if dense else layout, size > 1 if dense else partial)
    return sorted((c.kind, c.bytes, c.ranks) for c in out if rank in c.ranks)


@pytest.mark.parametrize("size", [pytest.param(2, marks=pytest.mark.long),
                                  pytest.param(4, marks=pytest.mark.slow)])
def test_declared_weight_bytes_and_collectives_match_the_built_ranks(size):
    ranks = measured(size)
    for name, (par_cfg, moe_cfg, model_cfg) in cases(size).items():
        for rank, got in enumerate(ranks):
            assert got[name]["weight_bytes"] == declared_weights(par_cfg, moe_cfg, model_cfg, rank), (name, rank)
            assert sorted(got[name]["collectives"]) == declared_collectives(par_cfg, moe_cfg, model_cfg, rank), \
                (name, rank)
        plan = plan_memory(model_cfg, make_cfg().engine, PARALLELISM.get(par_cfg.name), par_cfg,
                           MOE.get(moe_cfg.name), moe_cfg)
        assert plan.weight_bytes_total == max(declared_weights(par_cfg, moe_cfg, model_cfg, r) for r in range(size))


def test_dp_attention_replicates_attention_embedding_and_lm_head_and_tp_slices_them():
    tp, dp = make_cfg("parallel=tp", "moe=ep"), make_cfg("parallel=dp_attn", "moe=ep")
    tp_parts = PARALLELISM.get("tp").weight_bytes(tp.parallel, tp.model, 0, False)
    dp_parts = PARALLELISM.get("dp_attn").weight_bytes(dp.parallel, dp.model, 0, False)
    assert dp_parts["embedding"] == dp_parts["lm_head"] == 2 * tp_parts["embedding"] == 2 * tp_parts["lm_head"]
    assert dp_parts["attention"] > tp_parts["attention"]
    for part in ("dense_ffn", "shared_experts", "norms", "moe_gate"):   # the same under both schemes
        assert dp_parts[part] == tp_parts[part]


def test_after_the_ffn_sglang_all_reduces_every_token_and_the_switch_reduce_scatters():
    """Rank r holds counts[r] tokens. SGLang v0.4 (the default): padded all-gather, the layer's all-reduce over all
    tokens, keep one's rows. parallel.ffn_comm=reduce_scatter: the same gather, then only one's rows' sums."""
    counts, plugin = [3, 5, 0, 2], PARALLELISM.get("dp_attn")
    for ffn_comm in ("padded_all_gather", "reduce_scatter"):
        cfg = make_cfg("parallel=dp_attn", "parallel.size=4", f"parallel.ffn_comm={ffn_comm}")
        row = cfg.model.hidden_size * 4
        after = ("all_reduce", sum(counts) * row) if ffn_comm == "padded_all_gather" else \
            ("reduce_scatter", 4 * max(counts) * row)
        comm = plugin.layer_comm(cfg.parallel, cfg.model, counts, "all", True)
        assert [(c.kind, c.bytes) for c in comm] == [("all_gather", 4 * max(counts) * row), after]
        assert plugin.layer_comm(cfg.parallel, cfg.model, counts, "all", False) == comm[:1]   # complete: no reduce
        assert plugin.layer_comm(cfg.parallel, cfg.model, counts, "local", False) == []       # the backend's own
