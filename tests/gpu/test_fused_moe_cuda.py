"""The compiled fused MoE kernel on a GPU: against the fp32 loop oracle at the tiny model's and DeepSeek-V2-Lite's
expert shapes in fp32, fp16 and bf16; captured into a CUDA graph and replayed on other routings; no host sync on the
MoE path of the serving model. Skipped without CUDA (`pytest -m gpu`)."""

import pytest
import torch

from kernels.fused_moe import fused_moe_reference, fused_moe_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {"tiny": dict(E=8, I=64, H=128, top_k=2), "v2lite": dict(E=64, I=1408, H=2048, top_k=6)}
# ||out - ref|| / ||ref|| bounds: fp32 runs tl.dot in IEEE fp32 (only the summation order differs from the oracle);
# fp16/bf16 round the inputs, the intermediate activation and the output to 11 / 8 significant bits.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def layer_inputs(T: int, E: int, I: int, H: int, top_k: int, seed: int, dtype: torch.dtype):
    """Random inputs scaled so activations are O(1); router-like top-k (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    weights, ids = torch.randn(T, E, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return (*(t.to("cuda", dtype) for t in (hidden, w13, w2)), ids.cuda(), weights.to("cuda", dtype))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "the kernel wrote NaN or inf"
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("dtype", REL_TOL, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 7, 64, 333])
def test_compiled_kernel_matches_the_oracle(shape, dtype, T):
    hidden, w13, w2, ids, weights = layer_inputs(T, **SHAPES[shape], seed=T, dtype=dtype)
    name = torch.cuda.get_device_name()
    got = fused_moe_triton(hidden, w13, w2, ids, weights, device_name=name)   # the shipped tuned configs, if any
    assert got.dtype == dtype and got.shape == hidden.shape
    assert rel_err(got, fused_moe_reference(hidden, w13, w2, ids, weights)) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_local_experts_and_expert_offset(dtype):
    """Expert parallelism: half the experts on this rank, global ids with expert_offset; the rest contribute 0."""
    hidden, w13, w2, ids, weights = layer_inputs(48, **SHAPES["v2lite"], seed=1, dtype=dtype)
    want = fused_moe_reference(hidden, w13[32:], w2[32:], ids, weights, expert_offset=32)
    got = fused_moe_triton(hidden, w13[32:], w2[32:], ids, weights, expert_offset=32,
                           device_name=torch.cuda.get_device_name())
    assert rel_err(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("shape", SHAPES)
def test_captured_graph_replays_other_routings(shape):
    """Capture the whole layer (alignment and kernels) once, then replay it on routings whose padded lengths
    differ from the captured one's (spread over experts, all on one expert): right only if no size was read on the
    host at capture time."""
    s = SHAPES[shape]
    T = 8
    hidden, w13, w2, ids, weights = layer_inputs(T, **s, seed=2, dtype=torch.bfloat16)
    run = lambda: fused_moe_triton(hidden, w13, w2, ids, weights, device_name=torch.cuda.get_device_name())  # noqa: E731
    run()   # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    one_expert = torch.stack([torch.arange(s["top_k"])] * T)   # every token on experts 0..k-1: fewest blocks
    for seed, new_ids in [(3, None), (4, one_expert), (5, None)]:
        new_hidden, _, _, drawn_ids, new_weights = layer_inputs(T, **s, seed=seed, dtype=torch.bfloat16)
        hidden.copy_(new_hidden)
        ids.copy_(drawn_ids if new_ids is None else new_ids.cuda())
        weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, fused_moe_reference(hidden, w13, w2, ids, weights)) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("moe", ["triton_fused", "ep"])
def test_moe_layers_of_the_serving_model_never_sync(moe):
    """Router, routed experts and shared experts of every MoE layer: no host sync (a CUDA graph can hold them);
    the counter itself sees the syncs of the reference backend, which sizes each expert's batch on the host."""
    from framework.dist import Group
    from framework.engine.config import EngineConfig
    from framework.engine.engine import Engine
    from framework.model.config import ModelConfig
    from framework.contracts.moe import count_host_syncs
    from framework.contracts.parallel import Parallelism, ParallelConfig
    from framework.core.registry import MOE

    def layers(name):
        engine = Engine(ModelConfig(dtype="bfloat16"), EngineConfig(device="cuda"),
                        Parallelism(ParallelConfig(), Group()), MOE.get(name).Config(), seed=0)
        return engine.model.moe_layers()

    x = torch.randn(32, ModelConfig().hidden_size, device="cuda", dtype=torch.bfloat16)
    for layer in layers(moe):
        layer(x)   # compiles
        assert count_host_syncs(lambda: layer(x)) == 0
    assert count_host_syncs(lambda: layers("reference")[0](x)) > 0
