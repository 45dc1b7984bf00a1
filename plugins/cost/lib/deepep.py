"""DeepEP's dispatch and combine (SGLang 2025, `moe.dispatch=deepep_*`), priced from DeepEP's published tables
(deepseek-ai/DeepEP, README "Performance", kept as docs/legacy.md since V2: H800, CX7 400 Gb/s InfiniBand):

- normal kernels (prefill; tokens travel once per destination node over RDMA and fan out over NVLink, the receiver's
  count read back to the host first, so no CUDA graph): bottleneck bandwidth by EP size, measured with 4096 tokens,
  hidden 7168, top-4 groups, top-8 experts, FP8 dispatch, BF16 combine;
- low-latency kernels (decode; pure RDMA, one copy per (token, expert), fixed buffers, CUDA-graph capturable, the
  receive a hook that holds no SM): latency and RDMA bandwidth by EP size, measured with 128 tokens per rank, hidden
  7168, top-8, FP8 dispatch, BF16 combine.

A layer's time is its bytes over the table's bandwidth at its EP size (linear between the measured sizes, the
nearest outside them): the table's own latencies are those bytes over that bandwidth at 128 tokens, so this
reproduces them exactly there and scales with the tokens elsewhere. No fixed per-call latency is published: none.
"""
from __future__ import annotations

from math import comb

from framework.gpu.tables import bracket

# EP size -> (dispatch GB/s, combine GB/s); 8: intranode NVLink, above: internode RDMA
NORMAL_GB_S = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
# EP size -> (dispatch us, dispatch GB/s, combine us, combine GB/s) at LOW_LATENCY_TOKENS tokens per rank
LOW_LATENCY = {8: (77, 98.0, 114, 127.0), 16: (118, 63.0, 195, 74.0), 32: (155, 48.0, 273, 53.0),
               64: (173, 43.0, 314, 46.0), 128: (192, 39.0, 369, 39.0), 256: (194, 39.0, 360, 40.0)}
LOW_LATENCY_TOKENS = 128
FP8_SCALE_BLOCK = 128          # DeepEP's FP8 dispatch: one fp32 scale per 128 channels of a row

MODES = ("deepep_normal", "deepep_low_latency", "deepep_auto")


def mode_for(dispatch: str, decode: bool) -> str:
    """The kernels a step runs: SGLang's --deepep-mode auto picks low-latency for a decode batch, normal otherwise."""
    if dispatch == "deepep_auto":
        return "deepep_low_latency" if decode else "deepep_normal"
    return dispatch


def graph_capturable(mode: str) -> bool:
    """Only the low-latency kernels run in a CUDA graph: the normal ones read the received counts back to the host."""
    return mode == "deepep_low_latency"


def _interp(table: dict[int, tuple], ep: int, col: int) -> float:
    lo, hi, w = bracket(table, ep)
    return table[lo][col] if lo == hi else table[lo][col] + w * (table[hi][col] - table[lo][col])


def row_bytes(hidden: int, fp8: bool, act_bytes: int) -> float:
    """One token row as dispatched: FP8 with its scales, or the activations' dtype."""
    return hidden * (1 + 4 / FP8_SCALE_BLOCK) if fp8 else hidden * act_bytes


def destination_nodes(nodes: int, experts: int, top_k: int, n_group: int, topk_group: int) -> float:
    """Nodes a token's top-k experts live on, in expectation: group-limited routing (DeepSeek-V3: topk_group of
    n_group groups, groups spread evenly over nodes) picks its groups uniformly; else k experts uniformly."""
    if nodes <= 1:
        return 1.0
    if n_group > 1 and topk_group and n_group % nodes == 0:
        per_node = n_group // nodes
        return nodes * (1 - comb(n_group - per_node, topk_group) / comb(n_group, topk_group))
    per_node = experts // nodes
    return nodes * (1 - comb(experts - per_node, top_k) / comb(experts, top_k))


def normal_s(tokens: float, ep: int, gpus_per_node: int, model, dispatch_fp8: bool, act_bytes: int) -> tuple[float, float]:
    """(dispatch, combine) seconds of one layer's normal kernels for `tokens` tokens on the busiest rank: within a
    node a row goes once to each destination rank over NVLink; across nodes once to each destination node over
    RDMA (the bottleneck the table measures)."""
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    nodes = -(-ep // gpus_per_node)
    if nodes == 1:
        per_rank = model.n_routed_experts // ep
        copies = ep * (1 - comb(model.n_routed_experts - per_rank, model.num_experts_per_tok)
                       / comb(model.n_routed_experts, model.num_experts_per_tok))
    else:
        copies = destination_nodes(nodes, model.n_routed_experts, model.num_experts_per_tok, model.n_group,
                                   model.topk_group)
    d_bw, c_bw = _interp(NORMAL_GB_S, ep, 0) * 1e9, _interp(NORMAL_GB_S, ep, 1) * 1e9
    return (tokens * copies * row_bytes(model.hidden_size, dispatch_fp8, act_bytes) / d_bw,
            tokens * copies * model.hidden_size * act_bytes / c_bw)


def low_latency_s(tokens: float, ep: int, model, dispatch_fp8: bool, act_bytes: int) -> tuple[float, float]:
    """(dispatch, combine) seconds of one layer's low-latency kernels: every (token, expert) copy over RDMA."""
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    copies = tokens * model.num_experts_per_tok
    d_bw, c_bw = _interp(LOW_LATENCY, ep, 1) * 1e9, _interp(LOW_LATENCY, ep, 3) * 1e9
    return (copies * row_bytes(model.hidden_size, dispatch_fp8, act_bytes) / d_bw,
            copies * model.hidden_size * act_bytes / c_bw)
