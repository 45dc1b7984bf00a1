"""What the document-scale reproductions rest on: fp8 weights in the memory plan, SGLang's running-request cap, the
MLA decode kernel's head blocks in the roofline, and experiment configs that choose mode=sim themselves."""
from dataclasses import replace

import pytest

from framework.config import compose
from framework.engine.config import EngineConfig, sglang_max_running_requests
from framework.engine.engine import Engine, plan_memory
from framework.engine.kv_pool import CountingKVPool
from framework.engine.scheduler import Scheduler
from framework.contracts.parallel import attention_params
from framework.core.registry import COST, MOE, PARALLELISM
from framework.contracts.cost import InstanceShape, Step, decode_shape
from framework.runs.sim import simulate


@pytest.fixture(scope="module")
def v2():
    return compose(["model=deepseek_v2", "hardware=h100_sxm"])


def test_sglang_running_cap_matches_its_formula_by_brute_force():
    for kv in (10, 3000, 100_000, 564_434, 3_000_000, 50_000_000):
        for ctx in (2048, 16384, 163840):
            rows = min(max(int(kv / ctx * 512), 2048), 4096) + 1
            assert sglang_max_running_requests(kv, ctx) == max(min(kv // 2, rows), 1)
    sched = Scheduler(EngineConfig(max_running_requests=None), CountingKVPool(564_434), -1, lambda ids: "",
                      context_len=163840)
    assert sched.max_running == 2049
    assert Scheduler(EngineConfig(), CountingKVPool(1000), -1, lambda ids: "").max_running == 256


@pytest.mark.parametrize("parallel", ["tp", "dp_attn"])
def test_fp8_weights_take_one_byte_per_linear_parameter(v2, parallel):
    par_cls, moe_cls = PARALLELISM.get(parallel), MOE.get("triton_fused")
    par_cfg, moe_cfg = par_cls.Config(size=8), moe_cls.Config()
    engine = EngineConfig(mem_budget_mb=110_000)     # bf16 DP attention needs an H200
    bf16 = plan_memory(v2.model, engine, par_cls, par_cfg, moe_cls, moe_cfg)
    fp8 = plan_memory(replace(v2.model, weight_dtype="fp8"), engine, par_cls, par_cfg, moe_cls, moe_cfg)
    m = v2.model
    for part in ("embedding", "lm_head", "norms", "moe_gate"):          # stay bf16
        assert fp8.weight_bytes[part] == bf16.weight_bytes[part]
    for part in ("attention", "dense_ffn", "shared_experts", "routed_experts"):   # 2 bytes -> 1
        assert 2 * fp8.weight_bytes[part] == bf16.weight_bytes[part]
    heads = m.num_heads // 8 if parallel == "tp" else m.num_heads
    assert fp8.weight_bytes["attention"] == m.num_layers * attention_params(m, heads)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token and fp8.kv_tokens > bf16.kv_tokens


def test_the_engine_refuses_fp8_weights_it_would_not_build():
    cfg = compose(["model.weight_dtype=fp8"])
    par = PARALLELISM.get("single")(cfg.parallel, None)
    with pytest.raises(ValueError, match="model.weight_dtype=fp8 sizes and prices weights in mode=sim only"):
        Engine(cfg.model, cfg.engine, par, cfg.moe, 0)


def test_decode_kernel_reads_the_latent_once_per_16_heads(v2):
    def attention_s(parallel, block, batch=256, context=2048):
        inst = InstanceShape(v2.model, v2.hardware, parallel, 8, "triton_fused")
        cost = COST.build("roofline", COST.get("roofline").Config(decode_head_block=block, mla_decode_kv_splits=0),
                          inst)                  # one stage: the latent reads alone (the partials: test_v04_terms)
        shapes = tuple(decode_shape(batch, batch * context) for _ in range(cost.lay.groups))
        return cost.step_breakdown(Step(shapes))["attention_s"]
    assert attention_s("tp", 16) == attention_s("tp", 0)               # 16 heads per rank: one block
    assert attention_s("dp_attn", 16) > 3 * attention_s("dp_attn", 0)  # 128 heads: 8 reads of a long latent
    with pytest.raises(ValueError, match="sim.cost.decode_head_block must be >= 0"):
        COST.build("roofline", COST.get("roofline").Config(decode_head_block=-1),
                   InstanceShape(v2.model, v2.hardware, "tp", 8, "triton_fused"))


def test_an_experiment_chooses_mode_sim_and_the_pr1970_setup_runs_small():
    cfg = compose(["experiment=pr1970", "parallel=dp_attn", "workload.num_prompts=64", "workload.output_len=16"])
    assert cfg.mode.value == "sim" and cfg.model.weight_dtype == "fp8" and cfg.engine.max_running_requests is None
    results, records = simulate(cfg)
    assert results["requests_completed"] == 64 and results["kv_capacity_tokens_instance"] > 3_000_000
    assert results["output_throughput_tok_s"] > 0 and len(records) == 64
