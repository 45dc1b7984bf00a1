"""sim.cost=distserve_profile (experiments/pd_repro round 4): DistServe's artifact's step-time profile, each system's
own coefficients. The oracle is simdistserve's formula (estimators/time_estimator.py) written out here over the
shipped coefficients: a run priced by any other cost model gives other times and fails."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, CostModel, Step, decode_shape
from framework.core.errors import UserError
from framework.core.registry import COST, WORKLOAD
from framework.runs.sim import build, cost_instance
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
PROFILE = json.loads((ROOT / "experiments/pd_repro/distserve_profile_a100.json").read_text())
BASE = ["mode=sim", "logger.mode=disabled", "model=opt13b_mla", "hardware=a100_80g", "sim.cost=distserve_profile"]


def prefill_ms(system: str, tp: int, lens: list[int]) -> float:
    a, b, c = PROFILE["systems"][system][str(tp)]["prefill"]
    return a + b * sum(lens) + c * sum(x * x for x in lens)


def decode_ms(system: str, tp: int, contexts: list[int]) -> float:
    p = PROFILE["systems"][system][str(tp)]
    a, b, c = p["decoding_smallbs"] if len(contexts) < p["decoding_large_small_bs_threshold"] else p["decoding_largebs"]
    return a + b * sum(x + 1 for x in contexts) + c * len(contexts)


@pytest.fixture(scope="module")
def shape():
    """One instance's shape (OPT-13B's stand-in on an A100): each profile is priced on it, resized, with no compose."""
    return cost_instance(compose(BASE + ["parallel=single"]))


def profile(shape, system: str, tp: int = 1, **model) -> CostModel:
    model_cfg = dataclasses.replace(shape.model, **model) if model else shape.model
    return COST.build("distserve_profile", COST.get("distserve_profile").Config(system=system),
                      dataclasses.replace(shape, size=tp, model=model_cfg))


def test_each_system_and_tp_prices_steps_with_its_own_profile(shape):
    for system, tp in (("vllm", 1), ("distserve", 2), ("distserve", 1)):
        m = profile(shape, system, tp)
        lens = [300, 1200]
        assert m.step_time(Step((BatchShape("extend", tuple(lens), (0, 0)),))) == pytest.approx(
            prefill_ms(system, tp, lens) * 1e-3, rel=1e-12)
        for batch in (8, 95, 200):     # both sides of the artifact's small/large batch split
            ctx = [700] * batch
            assert m.step_time(Step((decode_shape(batch, sum(ctx)),))) == pytest.approx(
                decode_ms(system, tp, ctx) * 1e-3, rel=1e-12)
            assert m.decode_times((batch,), (sum(ctx),), 3) == pytest.approx(
                [decode_ms(system, tp, [700 + j] * batch) * 1e-3 for j in range(3)], rel=1e-12)
    # a prompt cut in two chunks costs its whole quadratic term and one more intercept
    m = profile(shape, "vllm")
    whole = m.step_time(Step((BatchShape("extend", (1000,), (0,)),)))
    cut = sum(m.step_time(Step((BatchShape("extend", (n,), (p,)),))) for n, p in ((600, 0), (400, 600)))
    assert cut - whole == pytest.approx(PROFILE["systems"]["vllm"]["1"]["prefill"][0] * 1e-3, rel=1e-9)


def test_a_run_with_the_switch_prices_its_first_token_and_decodes_by_the_profile():
    cfg = compose(BASE + ["sim.cost.system=vllm", "parallel=single", "workload=random", "workload.num_prompts=1",
                          "workload.input_len=512", "workload.range_ratio=1.0", "workload.output_len=9",
                          "workload.max_concurrency=1", "sim.network_latency_s=0", "sim.router_overhead_s=0",
                          "engine.radix_cache=false", "engine.mem_budget_mb=77824"])
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    (rec,), _ = build(cfg, sessions).run()
    assert rec.ok and rec.prompt_tokens == 512 and rec.completion_tokens == 9
    assert rec.ttft_s == pytest.approx(prefill_ms("vllm", 1, [512]) * 1e-3, rel=1e-9)
    steps = [decode_ms("vllm", 1, [512 + j]) * 1e-3 for j in range(8)]
    assert rec.e2e_s - rec.ttft_s == pytest.approx(sum(steps), rel=1e-9)


def test_round_4_puts_each_system_on_its_own_profile():
    predict = load_script("experiments/pd_repro/predict.py")
    assert predict.cost_overrides("distserve_profile", "vllm") == ["sim.cost=distserve_profile", "sim.cost.system=vllm"]
    cfg, _, inst = predict.vllm_instance(None, 1, 1.0, rnd=4, cost="distserve_profile")
    (vllm,) = inst.values()
    assert cfg.sim.cost.name == "distserve_profile" and cfg.sim.cost.system == "vllm"
    assert vllm.cost.step_time(Step((BatchShape("extend", (400,), (0,)),))) == pytest.approx(
        prefill_ms("vllm", 1, [400]) * 1e-3)


def test_what_was_not_profiled_is_refused_with_what_was(shape):
    with pytest.raises(UserError, match="sim.cost.system='sglang' is not one of distserve, vllm"):
        profile(shape, "sglang")
    with pytest.raises(UserError, match="no vllm profile at 8 GPUs .*profiled: 1, 2, 4"):
        profile(shape, "vllm", 8)
    with pytest.raises(UserError, match="prices model=opt13b_mla .* on hardware=a100_80g only, not model=other"):
        profile(shape, "vllm", name="other")
