"""moe=ep: expert parallelism. Each rank owns num_experts / size whole experts (rank r: the r-th contiguous block).

Two dispatch forms (`moe.dispatch`):

- `all_to_all` (default; token layout "local", output complete): each rank passes only its own tokens. A token
  travels ONCE to each rank that owns at least one of its top-k experts, carrying its hidden row and all k (global
  ids, weights); the owner runs the grouped GEMM on its local experts (ids of other ranks' experts count as -1),
  applies the router weights there and returns one row per (token, rank) pair, which the sender adds up. Sending per
  (token, destination) rather than per copy moves at most min(k, size) rows per token instead of k, and the return
  trip already holds the weighted sum over that rank's experts. Row, ids and weights travel packed as bytes in one
  buffer, so a layer costs three collectives: the count exchange, the dispatch and the combine. Under DP attention
  no all-gather is needed at all.
- `all_reduce` (SGLang v0.4; layout "all", a partial sum when size > 1): every rank sees every token, computes only
  its own experts (zeros for the rest) and the parallelism plugin's all-reduce / reduce-scatter combines them.

A rank with no tokens (IDLE) joins every collective with empty buffers: the all-to-all exchanges zero counts.

Host syncs: `all_to_all` reads its send counts and the received counts back to the host every layer (torch's
all_to_all_single takes split sizes as Python ints), so a step that uses it cannot be captured into a CUDA graph;
`all_reduce` and size 1 read nothing back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from math import comb

import torch

from framework.contracts.moe import MoEBackend, routed_expert_bytes
from kernels import fused_moe_for
from framework.contracts.parallel import Collective
from framework.core.registry import MOE
from plugins.moe.triton_fused import Kernel


class Dispatch(enum.StrEnum):
    """How tokens reach their experts' ranks (`moe.dispatch`)."""
    all_to_all = "all_to_all"   # each to the ranks owning its experts, and back
    all_reduce = "all_reduce"   # SGLang v0.4: every rank sees every token, a sum over ranks combines


DISPATCHES = tuple(d.value for d in Dispatch)


@dataclass
class EPConfig:
    name: str = "ep"
    dispatch: Dispatch = Dispatch.all_to_all
    kernel: Kernel = Kernel.auto     # the grouped GEMM on the local experts


def expected_destinations(ranks: int, top_k: int, experts: int) -> float:
    """Ranks a token's top-k (distinct) experts live on, in expectation under uniform routing with whole experts
    split evenly: a rank holds none of them with probability C(E - E/n, k) / C(E, k)."""
    return ranks * (1.0 - comb(experts - experts // ranks, top_k) / comb(experts, top_k))


def local_expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """[first, last) global ids of the experts `rank` owns."""
    if num_experts % size:
        raise ValueError(f"moe=ep splits whole experts across ranks: n_routed_experts={num_experts} is not divisible "
                         f"by parallel.size={size}; use a size that divides {num_experts}")
    per_rank = num_experts // size
    return rank * per_rank, (rank + 1) * per_rank


def pack_rows(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One byte row per token: its hidden row, its k expert ids (int32) and k weights (fp32), so a single all-to-all
    carries everything whatever the hidden dtype (bit-exact: bytes are copied, never converted)."""
    return torch.cat([hidden.contiguous().view(torch.uint8),
                      topk_ids.to(torch.int32).contiguous().view(torch.uint8),
                      topk_weights.to(torch.float32).contiguous().view(torch.uint8)], dim=1)


def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, hidden_size: int, top_k: int):
    """Inverse of pack_rows: (hidden [n, H] in dtype, ids int64 [n, k], weights fp32 [n, k])."""
    cut = hidden_size * torch.empty(0, dtype=dtype).element_size()
    hidden = rows[:, :cut].contiguous().view(dtype)
    ids = rows[:, cut:cut + 4 * top_k].contiguous().view(torch.int32).long()
    return hidden, ids, rows[:, cut + 4 * top_k:].contiguous().view(torch.float32)


@MOE.register("ep")
class EPMoE(MoEBackend):
    Config = EPConfig
    token_layout, partial = "local", False    # the default dispatch; per config: layout()

    @classmethod
    def layout(cls, cfg, size: int) -> tuple[str, bool]:
        if cfg.dispatch not in DISPATCHES:
            raise ValueError(f"moe.dispatch={cfg.dispatch!r} is not one of {', '.join(DISPATCHES)}")
        return ("local", False) if cfg.dispatch == Dispatch.all_to_all else ("all", size > 1)

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, size: int) -> int:
        first, last = local_expert_range(model_cfg.n_routed_experts, rank, size)
        return routed_expert_bytes(model_cfg, experts=last - first)

    @classmethod
    def expert_split(cls, cfg, size: int) -> tuple[int, int]:
        return size, 1

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens: list[int]) -> list[Collective]:
        """all_to_all: the count exchange, the dispatch (a token's row and its k ids and weights, once to each rank
        owning one of its experts: `expected_destinations` under uniform routing) and the combine (a row back per
        pair), sized for the rank that sends the most; all_reduce: none of its own."""
        size = len(tokens)
        if cfg.dispatch != Dispatch.all_to_all or size == 1:
            return []
        m = model_cfg
        ranks, row = tuple(range(size)), m.hidden_size * m.itemsize
        pairs = max(tokens) * expected_destinations(size, m.num_experts_per_tok, m.n_routed_experts)
        return [Collective("all_to_all", 8 * size, ranks),
                Collective("all_to_all", round(pairs * (row + 8 * m.num_experts_per_tok)), ranks),
                Collective("all_to_all", round(pairs * row), ranks)]

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        super().__init__(cfg, w13, w2, group)
        self.first, self.last = local_expert_range(w13.shape[0], group.rank, group.size)
        self.experts_per_rank = self.last - self.first
        # copies: the layer's full tensors are freed once every backend is built (framework/engine/engine.py)
        self.w13, self.w2 = w13[self.first:self.last].clone(), w2[self.first:self.last].clone()
        self.fused_moe, self.device_name = fused_moe_for(cfg.kernel, w13.device)

    def _local_experts(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """Sum over this rank's experts only; slots of other ranks' experts contribute zero."""
        return self.fused_moe(hidden, self.w13, self.w2, topk_ids, topk_weights, expert_offset=self.first,
                              device_name=self.device_name)

    def forward(self, hidden, topk_ids, topk_weights):
        if self.cfg.dispatch == Dispatch.all_reduce or self.group.size == 1:
            return self._local_experts(hidden, topk_ids, topk_weights)
        return self._all_to_all(hidden, topk_ids, topk_weights)

    def _all_to_all(self, hidden, topk_ids, topk_weights):
        group, (num_tokens, top_k) = self.group, topk_ids.shape
        # One (token, destination rank) pair per rank owning any of the token's experts, ordered by destination.
        owner = topk_ids.long() // self.experts_per_rank
        wanted = torch.zeros(group.size, num_tokens, dtype=torch.uint8, device=hidden.device)
        wanted[owner, torch.arange(num_tokens, device=hidden.device)[:, None]] = 1
        # all_to_all_single takes its split sizes on the host: this read and the group's count exchange are the
        # layer's host syncs (framework.contracts.moe.count_host_syncs); the pair list below is sized from it.
        send_counts = wanted.sum(dim=1).tolist()
        pairs = torch.argsort(wanted.view(-1), descending=True, stable=True)[:sum(send_counts)]
        token = pairs % num_tokens   # destination-major: pair i*T + t goes to rank i

        payload = pack_rows(hidden[token], topk_ids[token], topk_weights[token])
        received, recv_counts = group.all_to_all_uneven(payload, send_counts)
        recv_hidden, recv_ids, recv_weights = unpack_rows(received, hidden.dtype, hidden.shape[1], top_k)
        recv_weights = recv_weights.to(topk_weights.dtype)

        expert_out = self._local_experts(recv_hidden, recv_ids, recv_weights)
        back, _ = group.all_to_all_uneven(expert_out, recv_counts, recv_counts=send_counts)
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, token, back.float()).to(hidden.dtype)
