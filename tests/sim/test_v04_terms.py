"""Issue 19's cost terms, each moving what it should: the host's scheduler time and SGLang's overlap scheduler, the
eager floor, the two-stage MLA decode's partials, fp8 activation quantization, the fused MoE's efficiency; the
front end of a server; v0.4.1's CUDA-graph buckets; the server's BOS."""
from dataclasses import replace
from types import SimpleNamespace

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step, decode_shape
from framework.engine.config import EngineConfig
from framework.engine.cuda_graph import GraphPolicy, capture_sizes
from framework.sim.frontend import FrontEnd
from roofline_helpers import cost, h100, v2  # noqa: F401 (v2, h100: fixtures)


def decode(n, context=256, groups=1, graph=True):
    return Step(tuple(BatchShape("decode", (1,) * n, (context,) * n) for _ in range(groups)), graph=graph)


def test_overlap_hides_the_scheduler_and_v04_chooses_it_per_backend_and_dp(v2, h100):
    off = cost(v2, h100, overlap_schedule="off", host_step_us=2000.0)
    on = cost(v2, h100, overlap_schedule="on", host_step_us=2000.0)
    step = decode(64)
    b_off, b_on = off.step_breakdown(step), on.step_breakdown(step)
    assert b_off["total_s"] == pytest.approx(b_off["forward_s"] + b_off["scheduler_s"])
    assert b_on["total_s"] == max(b_on["forward_s"], b_on["scheduler_s"]) < b_off["total_s"]
    assert not cost(v2, h100).overlap and not cost(v2, h100, parallel="dp_attn").overlap   # MLA on Triton: off
    assert cost(v2, h100, attention_backend="flashinfer").overlap           # one scheduler on FlashInfer: on
    assert not cost(v2, h100, parallel="dp_attn", attention_backend="flashinfer").overlap   # DP attention: off
    with pytest.raises(ValueError, match="overlap_schedule='sometimes' is not one of auto, on, off"):
        cost(v2, h100, overlap_schedule="sometimes")


def test_scheduler_time_grows_with_running_and_new_requests(v2, h100):
    c = cost(v2, h100, overlap_schedule="off")
    small, big = (c.step_breakdown(decode(n))["scheduler_s"] for n in (8, 512))
    assert big - small == pytest.approx((512 - 8) * c.cfg.host_running_us * c.cfg.host_speed_factor * 1e-6)
    one, many = (c.step_breakdown(Step((BatchShape("extend", (64,) * n, (0,) * n),)))["scheduler_s"] for n in (1, 9))
    assert many - one == pytest.approx(8 * c.cfg.host_new_req_us * c.cfg.host_speed_factor * 1e-6)
    dp = cost(v2, h100, parallel="dp_attn", overlap_schedule="off")      # DP ranks schedule at once: the slowest
    uneven = Step((BatchShape("decode", (1,) * 40, (9,) * 40),) + (BatchShape(),) * 7)
    assert dp.step_breakdown(uneven)["scheduler_s"] == pytest.approx(
        (dp.cfg.host_step_us + 40 * dp.cfg.host_running_us) * dp.cfg.host_speed_factor * 1e-6)


def test_the_scheduler_streams_each_requests_whole_output_every_step(v2, h100):
    """SGLang's stream_output hands each running request's output so far to the detokenizer every step: a decode
    step's scheduler time grows with its requests' generated tokens, and a run of steps prices each as alone."""
    c = cost(v2, h100, overlap_schedule="off", host_output_token_us=0.05)
    early, late = (c.step_breakdown(Step((BatchShape("decode", (1,) * 64, (300,) * 64, outputs=o),)))["scheduler_s"]
                   for o in (64, 64 * 400))
    assert late - early == pytest.approx(64 * 399 * 0.05 * c.cfg.host_speed_factor * 1e-6)
    run = c.decode_times((64,), (64 * 300,), 3, graph=False, outputs=(64 * 100,))
    alone = [c.step_time(Step((decode_shape(64, 64 * (300 + j), 64 * (100 + j)),))) for j in range(3)]
    assert run == pytest.approx(alone) and run[2] > run[0]
    assert cost(v2, h100, overlap_schedule="off").step_breakdown(      # off by default: outputs move nothing
        Step((BatchShape("decode", (1,) * 8, (9,) * 8, outputs=5000),)))["scheduler_s"] == pytest.approx(
        c.step_breakdown(decode(8, context=9))["scheduler_s"])
    with pytest.raises(ValueError, match="sim.cost.host_output_token_us=-1 must be >= 0"):
        cost(v2, h100, host_output_token_us=-1)


def test_an_extends_scheduler_time_has_a_part_per_request_and_one_per_token(v2, h100):
    c = cost(v2, h100, overlap_schedule="off", host_new_req_us=100.0, host_new_token_us=0.5)
    few, many = (c.step_breakdown(Step((BatchShape("extend", (512 // n,) * n, (0,) * n),)))["scheduler_s"]
                 for n in (1, 8))                                  # the same 512 tokens in 1 or 8 requests
    assert many - few == pytest.approx(7 * 100.0 * c.cfg.host_speed_factor * 1e-6)
    long = c.step_breakdown(Step((BatchShape("extend", (1024,), (0,)),)))["scheduler_s"]
    assert long - few == pytest.approx(512 * 0.5 * c.cfg.host_speed_factor * 1e-6)
    plain = cost(v2, h100, overlap_schedule="off", host_new_req_us=100.0)     # a decode step takes no per-token part
    assert c.step_breakdown(decode(64))["scheduler_s"] == plain.step_breakdown(decode(64))["scheduler_s"]
    for key in ("host_new_token_us", "tokenize_us_per_request"):
        with pytest.raises(ValueError, match=f"sim.cost.{key}=-1 must be >= 0"):
            cost(v2, h100, **{key: -1})


def test_an_eager_step_costs_at_least_the_hosts_launches_per_layer(v2, h100):
    c = cost(v2, h100)
    graph, eager = c.step_breakdown(decode(8, graph=True)), c.step_breakdown(decode(8, graph=False))
    floor = (v2.first_k_dense_replace * c.cfg.eager_dense_layer_us
             + (v2.num_layers - v2.first_k_dense_replace) * c.cfg.eager_moe_layer_us) * 1e-6
    assert eager["forward_s"] == pytest.approx(max(eager["gpu_s"], floor)) and eager["forward_s"] > graph["forward_s"]
    no_floor = cost(v2, h100, eager_floor=False).step_breakdown(decode(8, graph=False))
    assert no_floor["forward_s"] == max(no_floor["gpu_s"], no_floor["launch_s"]) < eager["forward_s"]


def test_two_stage_decode_writes_and_reads_the_fp32_partials(v2, h100):
    """Stage 1 writes B x H x splits x (kv_lora_rank + 1) fp32 values, stage 2 reads them: at a batch where the
    attention is memory bound, the difference is those bytes twice at the attention's bandwidth."""
    one, two = cost(v2, h100, mla_decode_kv_splits=0), cost(v2, h100, mla_decode_kv_splits=8)
    b, heads = 512, v2.num_heads // 8
    partials = b * heads * 8 * (v2.kv_lora_rank + 1) * 4
    extra = two.step_breakdown(decode(b))["attention_s"] - one.step_breakdown(decode(b))["attention_s"]
    rf = two.rf
    expected = v2.num_layers * (partials / rf._gemm_bw + rf.attention(partials / 2, partials))
    assert extra == pytest.approx(expected, rel=1e-6)


def test_fp8_quantization_and_the_fused_moe_efficiency_add_time(v2, h100):
    step = Step((BatchShape("extend", (4096,), (0,)),))
    base = cost(v2, h100, fp8_act_quant=False).step_breakdown(step)["ffn_s"]
    assert cost(v2, h100).step_breakdown(step)["ffn_s"] > base
    assert cost(v2, h100, fp8_act_quant=False, fused_moe_fp8_eff=0.5).step_breakdown(step)["ffn_s"] > base
    bf16 = replace(v2, weight_dtype=None)                         # no fp8 GEMM: nothing to quantize
    assert (cost(bf16, h100).step_breakdown(step)["ffn_s"]
            == cost(bf16, h100, fp8_act_quant=False).step_breakdown(step)["ffn_s"])
    with pytest.raises(ValueError, match="sim.cost.fused_moe_fp8_eff=0 must be > 0 and <= 1"):
        cost(v2, h100, fused_moe_fp8_eff=0)


def test_the_front_end_writes_chunks_in_order_and_a_run_equals_its_steps():
    cfg = SimpleNamespace(frontend=True, tokenize_us_per_token=2.0, stream_us_per_chunk=100.0, stream_interval=1)
    reqs = [SimpleNamespace(output_ids=[0] * 5, finished=i == 1) for i in range(3)]
    one = FrontEnd(cfg)
    for j, end in enumerate((1.0, 1.0001, 1.0002)):              # three steps one by one
        for r in reqs:
            r.output_ids = [0] * (3 + j)
        written = one.stream([end], reqs)
    run = FrontEnd(cfg)
    assert run.stream([1.0, 1.0001, 1.0002], reqs) == written
    assert written[1] == pytest.approx(1.0 + 8 * 100e-6)   # busy from the first step: 7 chunks before, its own 8th
    assert run.tokenize(2.0, 500) == pytest.approx(2.001)
    per_request = FrontEnd(SimpleNamespace(frontend=True, tokenize_us_per_request=300.0, tokenize_us_per_token=2.0))
    assert per_request.tokenize(5.0, 500) == pytest.approx(5.0013)       # HTTP's 300 us, then 500 tokens
    http_only = FrontEnd(SimpleNamespace(frontend=True, tokenize_us_per_request=300.0, tokenize_us_per_token=0.0))
    assert http_only.tokenize(5.0, 500) == pytest.approx(5.0003)          # no per-token price: HTTP's still
    off = FrontEnd(SimpleNamespace(frontend=False))
    assert off.stream([3.0], reqs) == [3.0] * 3 and off.tokenize(3.0, 10) == 3.0


def test_a_chunk_costs_more_as_its_requests_output_grows():
    """SGLang's chunk carries the request's whole output so far: a chunk's price is a fixed part and one per token."""
    cfg = SimpleNamespace(frontend=True, stream_us_per_chunk=50.0, stream_us_per_output_token=0.1, stream_interval=1)
    short, long = SimpleNamespace(output_ids=[0] * 10, finished=False), SimpleNamespace(output_ids=[0] * 500,
                                                                                       finished=False)
    fe = FrontEnd(cfg)
    assert fe.stream([1.0], [short]) == [pytest.approx(1.0 + (50 + 0.1 * 10) * 1e-6)]
    assert fe.stream([2.0], [long]) == [pytest.approx(2.0 + (50 + 0.1 * 500) * 1e-6)]
    assert fe.busy_s == pytest.approx((100 + 0.1 * 510) * 1e-6)


def test_v041_graph_buckets_and_the_v040_cap_under_dp_attention():
    assert capture_sizes(160, [], 100)[-3:] == [96, 99, 100]        # the pool's size and one less
    cfg = EngineConfig()
    assert GraphPolicy(cfg, True, 4096, 2048).sizes[-1] == 160       # v0.4.1 keeps 160 under DP attention
    assert GraphPolicy(replace(cfg, cuda_graph_dp_attention_max_bs=96), True, 4096, 2048).sizes[-1] == 96
    with pytest.raises(ValueError, match="engine.cuda_graph_dp_attention_max_bs must be >= 1"):
        EngineConfig(cuda_graph_dp_attention_max_bs=0).validate()


@pytest.mark.long
def test_the_servers_bos_is_one_more_prompt_token():
    from framework.runs.sim import simulate
    base = ["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=4", "workload.input_len=8",
            "workload.output_len=2", "workload.range_ratio=1.0"]
    for bos, tokens in (("false", 8), ("true", 9)):
        _, records = simulate(compose(base + [f"workload.bos={bos}"]))
        assert [r.prompt_tokens for r in records] == [tokens] * 4
