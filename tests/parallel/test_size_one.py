"""At parallel.size=1 every plugin is the single-rank engine: mode=verify passes in-process, no rank spawned. The
plugins' shape checks, layouts and options."""
import json

import pytest

from framework.app import run
from framework.core.errors import UserError
from framework.dist.group import Group
from framework.model.config import ModelConfig
from framework.core.registry import PARALLELISM
from parallel_helpers import assert_no_rank_left, make_cfg


@pytest.mark.parametrize("parallel", ["single", pytest.param("tp", marks=pytest.mark.long),
                                      pytest.param("dp_attn", marks=pytest.mark.long)])
def test_size_one_verify_passes_in_process(tmp_path, parallel):
    worst = run(make_cfg("mode=verify", f"parallel={parallel}", "parallel.size=1"), str(tmp_path), {})
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["verify_passed"] and worst == results["verify_max_abs_err"] <= 1e-4
    assert results["tight_kv_retract_retractions"] > 0
    assert (results["parallel"], results["parallel_size"]) == (parallel, 1)
    assert_no_rank_left([])


def test_default_sizes_are_the_smallest_that_split_anything(tmp_path):
    assert make_cfg().parallel.name == "single" and make_cfg().parallel.size == 1     # the quick start
    assert make_cfg("parallel=tp").parallel.size == 2
    assert make_cfg("parallel=dp_attn").parallel.size == 2
    dp_tp = make_cfg("parallel=dp_attn_tp").parallel
    assert (dp_tp.size, dp_tp.tp_size) == (4, 2)
    with pytest.raises(UserError, match="parallel=single runs one rank"):
        run(make_cfg("parallel=single", "parallel.size=2", "cluster.http=false"), str(tmp_path), {})


@pytest.mark.parametrize("parallel", ["tp", "dp_attn", "dp_attn_tp"])
def test_sizes_that_divide_the_model_fit(parallel):
    plugin = PARALLELISM.get(parallel)
    for size in (2, 4, 8):
        cfg = make_cfg(f"parallel={parallel}", f"parallel.size={size}").parallel
        assert plugin.check_fits(cfg, ModelConfig(), moe_partial=True) == []
    cfg = make_cfg(f"parallel={parallel}", "parallel.size=32").parallel
    assert plugin.check_fits(cfg, ModelConfig(n_shared_experts=1, moe_intermediate_size=48), moe_partial=True)


def test_dp_attn_tp_needs_tp_size_to_divide_size_and_the_heads():
    plugin, model = PARALLELISM.get("dp_attn_tp"), ModelConfig()
    odd = make_cfg("parallel=dp_attn_tp", "parallel.size=6", "parallel.tp_size=4").parallel
    assert plugin.check_fits(odd, model, False) == ["parallel.tp_size=4 must divide parallel.size=6 (ranks per DP "
                                                    "group)"]
    heads = make_cfg("parallel=dp_attn_tp", "parallel.size=6", "parallel.tp_size=3").parallel
    assert "model.num_heads=8 is not divisible by parallel.tp_size=3" in plugin.check_fits(heads, model, False)[0]
    assert plugin.dp_size(make_cfg("parallel=dp_attn_tp").parallel) == 2
    assert [plugin.dp_rank_of(make_cfg("parallel=dp_attn_tp").parallel, r) for r in range(4)] == [0, 0, 1, 1]


def test_kv_bytes_per_token_is_the_full_latent_under_every_scheme():
    model = ModelConfig()
    assert model.kv_bytes_per_token() == model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * 4
    for parallel in ("single", "tp", "dp_attn", "dp_attn_tp"):
        assert PARALLELISM.get(parallel).kv_bytes_per_token(model) == model.kv_bytes_per_token()   # MLA: one latent


def test_options_only_dp_attention_reads_live_on_its_plugins():
    for parallel, extra in (("dp_attn", []), ("dp_attn_tp", ["parallel.tp_size=1"])):
        cfg = make_cfg(f"parallel={parallel}", "parallel.size=1", *extra)
        par = PARALLELISM.build(parallel, cfg.parallel, Group())
        assert par.schedule_conservativeness == 0.3                  # SGLang #2096
        assert par.describe(cfg.parallel)["ffn_comm"] == "padded_all_gather"   # SGLang v0.4 by default
    tp = make_cfg("parallel=tp", "parallel.size=1")
    assert PARALLELISM.build("tp", tp.parallel, Group()).schedule_conservativeness == 1.0
    for key in ("idle_batches", "dp_balance", "schedule_conservativeness", "ffn_comm"):
        assert not hasattr(tp.parallel, key)
