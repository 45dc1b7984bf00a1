"""The MoE backend interface: what a `moe=` plugin implements (plugins/moe/). The fused kernels a backend calls are
kernels/'s to pick (kernels.fused_moe_for)."""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

TOKEN_LAYOUTS = ("all", "local")


@dataclass
class MoEConfig:
    name: str = ""          # the plugin's key: each plugin's Config names itself


class MoEBackend(ABC):
    """Computes the routed-expert output of one MoE layer.

    `token_layout` says what the backend takes: "all" (every rank of the instance holds every token of the step, the
    parallelism plugin gathers them under DP attention) or "local" (each rank passes only its own tokens; the backend
    moves them itself, e.g. all-to-all). `partial` says whether the output is a partial sum that the parallelism
    plugin must reduce across ranks (the plugin then also shards the shared experts, so they sum alike). An instance
    carries the values for its config and instance size; `layout(cfg, size)` gives them before any rank starts.
    Shared experts are not the backend's business (the model adds them).

    A rank with no tokens (an IDLE batch) still calls `forward` with `[0, H]` hidden states and `[0, k]` ids, and
    the backend must join every collective its peers make.

    `stats` holds the backend's counters since it was built, the whole instance's on every rank: a backend that
    re-places experts counts `eplb_rebalances`, `eplb_experts_moved` and `eplb_bytes_moved` there
    (framework.model.moe_stats.PLACEMENT_KEYS), which the engine sums over the MoE layers into results.json.
    """

    Config = MoEConfig
    token_layout: str = "all"
    partial: bool = False
    # its routed experts are SGLang v0.4's one fused MoE call over the rank's experts (fused_moe_triton): what a cost
    # model's published fused-MoE rates price (sim.cost.fused_moe_rates)
    fused_moe_call: bool = False

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        """w13: [E, 2*I, H] (gate rows then up rows), w2: [E, H, I]: the full expert weights of the layer;
        the backend keeps the part its rank owns."""
        self.cfg, self.group = cfg, group
        self.stats: dict[str, int] = {}
        self.token_layout, self.partial = self.layout(cfg, group.size)
        if self.token_layout not in TOKEN_LAYOUTS:
            raise ValueError(f"{type(self).__name__}.token_layout={self.token_layout!r} is not one of "
                             f"{', '.join(TOKEN_LAYOUTS)}")

    @classmethod
    def layout(cls, cfg, size: int) -> tuple[str, bool]:
        """(token_layout, partial) of this backend with `cfg` on `size` ranks. A partial sum needs size > 1."""
        return cls.token_layout, cls.partial and size > 1

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, size: int) -> int:
        """Bytes of the routed experts (every MoE layer's) that `rank` of `size` holds; the base: all of them."""
        return routed_expert_bytes(model_cfg)

    @classmethod
    def expert_split(cls, cfg, size: int) -> tuple[int, int]:
        """How `size` ranks share the routed experts, for a cost model: (ranks the experts are divided over as whole
        experts, ranks each expert's intermediate dim is sliced over). The base: every expert whole on every rank."""
        return 1, 1

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens: list[int]) -> list:
        """The backend's own collectives (framework.contracts.parallel.Collective) in one MoE layer when rank r passes it
        tokens[r] tokens; the base: none (it runs on the tokens the parallelism plugin laid out)."""
        return []

    @classmethod
    def expert_slots(cls, cfg, num_experts: int, size: int) -> tuple[int, ...] | None:
        """For a cost model: the physical expert slots before any rebalance, as the logical expert each holds (rank
        r holds slots [r P/size, (r+1) P/size)); None: the backend places no whole experts on ranks."""
        return None

    @classmethod
    def overlap_plan(cls, cfg, tokens: int, decode: bool) -> dict | None:
        """For a cost model: how one layer on `tokens` tokens of this rank overlaps communication with compute
        ({"micro_tokens": (a, b), "stages": names, "delta": B's lag in stages}); None: it does not."""
        return None

    def set_phase(self, decode: bool) -> None:
        """Whether this step decodes on every rank of the instance (the parallelism plugin says so before each MoE
        layer, the same on every rank): a backend that orders its collectives by phase reads it; the base ignores
        it."""

    def observe_loads(self, counts: torch.Tensor) -> None:
        """The layer's recorded expert loads (`MoE.expert_counts`, updated in place): a backend that places experts
        by load reads them; the base ignores them."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] in `token_layout`, topk_ids/topk_weights [T, k] -> routed output [T, H]."""


def routed_expert_bytes(model_cfg, experts: int | None = None, intermediate: int | None = None) -> int:
    """Bytes of `experts` routed experts (default all) of `intermediate` width (default the model's) over every MoE
    layer: gate, up and down projections."""
    c = model_cfg
    experts = c.n_routed_experts if experts is None else experts
    intermediate = c.moe_intermediate_size if intermediate is None else intermediate
    return (c.num_layers - c.first_k_dense_replace) * experts * 3 * c.hidden_size * intermediate * c.linear_itemsize


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times ``fn()`` makes the host wait for the GPU (``.item()``, ``.tolist()``, ``nonzero``, a copy to
    the CPU, a copy from pageable host memory, ...), counted by torch's CUDA sync debug mode. Each one stalls the
    step and rules out CUDA-graph capture: triton_fused makes none; ep's all-to-all needs its split sizes on the host
    (all_to_all_single takes them as ints), so it reads its send counts back and exchanges counts each layer. CUDA
    only: on a CPU nothing syncs."""
    if not torch.cuda.is_available():
        raise RuntimeError("count_host_syncs needs CUDA (it uses torch.cuda.set_sync_debug_mode)")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)
