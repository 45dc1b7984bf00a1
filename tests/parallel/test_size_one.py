"""At parallel.size=1 both plugins are the single-rank engine: mode=verify passes in-process, no rank spawned."""
import json

import pytest

from framework.app import run
from framework.dist.group import Group
from framework.model.config import ModelConfig
from framework.registry import PARALLELISM
from parallel_helpers import assert_no_rank_left, make_cfg


@pytest.mark.parametrize("parallel", ["tp", "dp_attn"])
def test_size_one_verify_passes_in_process(tmp_path, parallel):
    worst = run(make_cfg("mode=verify", f"parallel={parallel}"), str(tmp_path), {})
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["verify_passed"] and worst == results["verify_max_abs_err"] <= 1e-4
    assert results["tight_kv_retract_retractions"] > 0
    assert_no_rank_left([])


@pytest.mark.parametrize("parallel", ["tp", "dp_attn"])
def test_sizes_that_divide_the_model_fit(parallel):
    plugin = PARALLELISM.get(parallel)
    for size in (1, 2, 4, 8):
        assert plugin.check_fits(ModelConfig(), size, moe_partial=True) == []
    assert plugin.check_fits(ModelConfig(n_shared_experts=1, moe_intermediate_size=48), 32, moe_partial=True)


def test_kv_bytes_per_token_is_the_full_latent_under_both():
    model = ModelConfig()
    assert model.kv_bytes_per_token() == model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * 4
    for parallel in ("tp", "dp_attn"):
        cfg = make_cfg(f"parallel={parallel}")
        par = PARALLELISM.build(parallel, cfg.parallel, Group())
        assert par.kv_bytes_per_token(model) == model.kv_bytes_per_token()   # MLA: one latent, not split by heads
    assert make_cfg("parallel=tp").parallel.schedule_conservativeness == 1.0
    assert make_cfg("parallel=dp_attn").parallel.schedule_conservativeness == 0.3   # SGLang #2096
