"""conf/hardware/ and the DeepSeek model configs compose through Hydra; the shapes are the published models'."""
from pathlib import Path

import pytest

from framework.config import check_overrides, compose, group_overrides
from framework.core.registry import COST
from framework.gpu.hardware import Fit, HardwareConfig

CONF = Path(__file__).resolve().parents[2] / "conf"
# published parameter counts (model cards): total, activated per token
PUBLISHED = {"deepseek_v2": (236e9, 21e9), "deepseek_v2_lite": (15.7e9, 2.4e9), "deepseek_v3": (671e9, 37e9)}


def parameters(m, experts_per_token: int) -> float:
    """Parameters of the model with `experts_per_token` routed experts per MoE layer, counted from its shapes."""
    h = m.hidden_size
    q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * m.qk_head_dim if m.q_lora_rank
         else h * m.num_heads * m.qk_head_dim)
    attention = (q + h * m.kv_cache_width + m.kv_lora_rank + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim
                 + m.v_head_dim) + m.num_heads * m.v_head_dim * h + 2 * h)
    expert = 3 * h * m.moe_intermediate_size
    moe = m.n_routed_experts * h + (experts_per_token + m.n_shared_experts) * expert
    dense_layers = m.first_k_dense_replace
    return (2 * m.vocab_size * h + h + m.num_layers * attention + dense_layers * 3 * h * m.intermediate_size
            + (m.num_layers - dense_layers) * moe)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_deepseek_configs_compose_validate_and_match_published_sizes(name):
    cfg = compose([f"model={name}", "hardware=h200", "sim.cost=roofline"])
    m = cfg.model
    m.validate()
    total, active = PUBLISHED[name]
    assert abs(parameters(m, m.n_routed_experts) / total - 1) < 0.005, parameters(m, m.n_routed_experts)
    # activated counts are quoted to 2-3 digits, with or without the embeddings: a looser check
    assert abs(parameters(m, m.num_experts_per_tok) / active - 1) < 0.12
    assert m.dtype == "bfloat16" and m.kv_bytes_per_token() == m.num_layers * 576 * 2


def test_default_model_stays_tiny():
    cfg = compose([])
    assert cfg.model.name == "tiny_mla_moe" and cfg.hardware.name == "h100_sxm" and cfg.sim.cost.name == "calibrated"


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "hardware").glob("*.yaml")))
def test_every_hardware_composes_with_its_fitted_terms(name):
    hw = compose([f"hardware={name}"]).hardware
    assert isinstance(hw, HardwareConfig) and hw.name == name
    assert hw.bf16_tflops > 0 and hw.hbm_gb_s > 0 and hw.nvlink_gb_s > hw.inter_node_gb_s > 0
    fit = Fit.load(hw.fit)
    assert 0 < fit.gemm.compute_eff < 1 and 0 < fit.gemm.mem_eff < 1.2
    assert set(fit.memops) == {"rmsnorm", "act", "rope", "add", "emb"}


def test_every_cost_plugin_composes():
    for key in COST.keys():
        cfg = compose([f"sim/cost={key}"])
        assert isinstance(cfg.sim.cost, COST.get(key).Config)


def test_unknown_fit_and_fp8_on_a100_fail_clearly():
    with pytest.raises(ValueError, match="hardware.fit='nope'.*known: a100, h100"):
        Fit.load("nope")
    with pytest.raises(ValueError, match="a100_80g has no fp8 tensor cores"):
        compose(["hardware=a100_80g"]).hardware.peak_flops("fp8")


def test_cost_model_is_chosen_as_users_type_it():
    """`sim.cost=roofline` chooses the group's option (as `sim/cost=roofline`); its fields keep dotted keys."""
    assert group_overrides(["sim.cost=calibrated", "sim.cost.path=p.json", "+sim.cost=a,b", "seed=1"]) == \
        ["sim/cost=calibrated", "sim.cost.path=p.json", "+sim/cost=a,b", "seed=1"]
    cfg = compose(["sim.cost=calibrated", "sim.cost.path=p.json"])
    assert cfg.sim.cost.name == "calibrated" and cfg.sim.cost.path == "p.json"
    check_overrides(["mode=sim", "sim.cost=roofline", "model.weight_dtype=fp8", "hardware=b200"])
