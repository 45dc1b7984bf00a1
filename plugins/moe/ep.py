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

Beyond v0.4 (SGLang 2025; each off by default, v0.4's behaviour):

- expert placement (`moe.num_redundant_experts`, `moe.placement`): P = experts + redundant physical slots, rank r
  holds slots [r P/size, (r+1) P/size) (plugins/moe/lib/placement.py); a token's expert goes to the least-loaded
  of its replicas. P = E in order is v0.4's blocks.
- EPLB (`moe.eplb.rebalance_every` > 0): every that many forward passes of the layer, the expert loads the layer
  recorded since the last rebalance (its `expert_counts`, summed over the ranks) place the slots anew by
  deepseek-ai/EPLB's algorithm (framework/contracts/eplb.py) and each rank receives the experts it lacks over one
  all-to-all; `stats` counts the rebalances, the experts moved and their bytes.
- two-batch overlap (`moe.tbo`): the all-to-all dispatch in two micro-batches, each one's dispatch and combine in
  flight (async) while the other's experts compute; micro-batch B lags two stages when the instance decodes, none
  in prefill (SGLang's offsets; the parallelism plugin tells the phase: `set_phase`), unless
  `moe.tbo_delta_stages` fixes it (plugins/moe/lib/tbo.py).

Host syncs: `all_to_all` reads its send counts and the received counts back to the host every layer (torch's
all_to_all_single takes split sizes as Python ints), so a step that uses it cannot be captured into a CUDA graph;
`all_reduce` and size 1 read nothing back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from math import comb
from typing import Optional

import torch

from framework.contracts.moe import MoEBackend, routed_expert_bytes
from kernels import fused_moe_for
from framework.contracts.parallel import Collective
from framework.core.registry import MOE
from plugins.moe.lib import tbo as overlap
from plugins.moe.lib.a2a import exchange_counts, launch_all_to_all
from framework.contracts.eplb import Policy, rebalance
from plugins.moe.lib.placement import Placement, contiguous, physical_ids, shuffled
from plugins.moe.triton_fused import Kernel


class Dispatch(enum.StrEnum):
    """How tokens reach their experts' ranks (`moe.dispatch`)."""
    all_to_all = "all_to_all"   # each to the ranks owning its experts, and back
    all_reduce = "all_reduce"   # SGLang v0.4: every rank sees every token, a sum over ranks combines
    # SGLang 2025's DeepEP (--deepep-mode normal | low_latency | auto): run here as all_to_all (same tokens, same
    # logits); mode=sim prices DeepEP's kernels and their CUDA-graph rule (plugins/cost/lib/deepep.py)
    deepep_normal = "deepep_normal"
    deepep_low_latency = "deepep_low_latency"
    deepep_auto = "deepep_auto"


DISPATCHES = tuple(d.value for d in Dispatch)


class InitialPlacement(enum.StrEnum):
    """Where the physical slots start (`moe.placement`), before any rebalance."""
    contiguous = "contiguous"   # slot s holds expert s mod E: v0.4's blocks when there are no redundant slots
    shuffled = "shuffled"       # the same slots in a random order from moe.placement_seed: experts anywhere


@dataclass
class EPLBConfig:
    rebalance_every: int = 0          # forward passes of a layer between rebalances; 0: never (v0.4)
    policy: Policy = Policy.auto      # auto: hierarchical when num_groups divides among num_nodes, else global
    num_groups: int = 1               # expert groups kept on one node (DeepSeek's n_group; 1: no grouping)
    num_nodes: int = 1                # nodes the ranks are spread over


@dataclass
class EPConfig:
    name: str = "ep"
    dispatch: Dispatch = Dispatch.all_to_all
    kernel: Kernel = Kernel.auto     # the grouped GEMM on the local experts
    num_redundant_experts: int = 0   # physical slots beyond one per expert (v0.4: 0)
    placement: InitialPlacement = InitialPlacement.contiguous
    placement_seed: int = 0
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    tbo: bool = False                # two-batch overlap of the all-to-all dispatch (v0.4: off)
    tbo_delta_stages: Optional[int] = None   # B's lag in stages; None: SGLang's by the step's phase (decode 2, prefill 0)


def initial_placement(cfg, num_experts: int, size: int) -> Placement:
    """The slots before any rebalance, the same on every rank."""
    if cfg.num_redundant_experts < 0:
        raise ValueError(f"moe.num_redundant_experts={cfg.num_redundant_experts} must be >= 0")
    physical = num_experts + cfg.num_redundant_experts
    if physical % size:
        raise ValueError(f"moe=ep splits {physical} expert slots (n_routed_experts={num_experts} + "
                         f"moe.num_redundant_experts={cfg.num_redundant_experts}) across parallel.size={size} ranks, "
                         f"which does not divide them; make experts + redundant divisible by {size}")
    if cfg.placement == InitialPlacement.shuffled:
        return shuffled(num_experts, physical, size, cfg.placement_seed)
    if cfg.placement != InitialPlacement.contiguous:
        raise ValueError(f"moe.placement={cfg.placement!r} is not one of {', '.join(InitialPlacement)}")
    return contiguous(num_experts, physical, size)


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
        return ("local", False) if cfg.dispatch != Dispatch.all_reduce else ("all", size > 1)

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, size: int) -> int:
        if not cfg.num_redundant_experts:
            first, last = local_expert_range(model_cfg.n_routed_experts, rank, size)
            return routed_expert_bytes(model_cfg, experts=last - first)
        return routed_expert_bytes(model_cfg, experts=initial_placement(cfg, model_cfg.n_routed_experts,
                                                                        size).slots_per_rank)

    @classmethod
    def expert_split(cls, cfg, size: int) -> tuple[int, int]:
        return size, 1

    @classmethod
    def layer_comm(cls, cfg, model_cfg, tokens: list[int]) -> list[Collective]:
        """all_to_all: the count exchange, the dispatch (a token's row and its k ids and weights, once to each rank
        owning one of its experts: `expected_destinations` under uniform routing) and the combine (a row back per
        pair), sized for the rank that sends the most; all_reduce: none of its own. Under moe.tbo each micro-batch
        makes the three (plugins/moe/lib/tbo.py: moe_plan says how they overlap)."""
        size = len(tokens)
        if cfg.dispatch == Dispatch.all_reduce or size == 1:
            return []
        m = model_cfg
        ranks, row = tuple(range(size)), m.hidden_size * m.itemsize
        pairs = max(tokens) * expected_destinations(size, m.num_experts_per_tok, m.n_routed_experts)
        return [Collective("all_to_all", 8 * size, ranks),
                Collective("all_to_all", round(pairs * (row + 8 * m.num_experts_per_tok)), ranks),
                Collective("all_to_all", round(pairs * row), ranks)]

    @classmethod
    def expert_slots(cls, cfg, num_experts: int, size: int) -> tuple[int, ...]:
        return initial_placement(cfg, num_experts, size).phy2log

    @classmethod
    def overlap_plan(cls, cfg, tokens: int, decode: bool) -> dict | None:
        """Under moe.tbo, the micro-batches and stages of the all-to-all layer; the offset is SGLang's for the mode
        (decode 2, prefill 0) unless moe.tbo_delta_stages fixes one, as the real path runs it."""
        if not cfg.tbo or cfg.dispatch == Dispatch.all_reduce:
            return None
        d = cfg.tbo_delta_stages
        plan = overlap.moe_plan(tokens, overlap.delta_stages(decode) if d is None else d)
        return {"micro_tokens": plan.micro_tokens, "stages": plan.stages, "delta": plan.delta}

    def __init__(self, cfg, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        super().__init__(cfg, w13, w2, group)
        num_experts = w13.shape[0]
        self.placement = initial_placement(cfg, num_experts, group.size)
        if cfg.eplb.rebalance_every < 0:
            raise ValueError(f"moe.eplb.rebalance_every={cfg.eplb.rebalance_every} must be >= 0 (0: never)")
        if cfg.tbo_delta_stages is not None and not 0 <= cfg.tbo_delta_stages <= len(overlap.MOE_STAGES):
            raise ValueError(f"moe.tbo_delta_stages={cfg.tbo_delta_stages} must be in 0..{len(overlap.MOE_STAGES)}")
        self.experts_per_rank = self.placement.slots_per_rank
        slots = self.placement.local_slots(group.rank)
        self.first = slots.start
        # copies: the layer's full tensors are freed once every backend is built (framework/engine/engine.py)
        index = torch.tensor([self.placement.phy2log[s] for s in slots], dtype=torch.long, device=w13.device)
        self.w13, self.w2 = w13.index_select(0, index), w2.index_select(0, index)
        self._set_tables()
        self.fused_moe, self.device_name = fused_moe_for(cfg.kernel, w13.device)
        # the layer's recorded loads (observe_loads; else counted here) and their value at the last rebalance
        self.loads = torch.zeros(num_experts, dtype=torch.int64, device=w13.device)
        self._own_loads, self._loads_at_rebalance, self.forwards = True, self.loads.clone(), 0
        self.decode = False   # the instance's phase this step (set_phase): two-batch overlap's stage order
        self.stats = {"eplb_rebalances": 0, "eplb_experts_moved": 0, "eplb_bytes_moved": 0}
        self.slots_computed = torch.zeros((), dtype=torch.int64, device=w13.device)   # (token, expert) pairs run here

    def set_phase(self, decode: bool) -> None:
        self.decode = decode

    def tbo_delta(self) -> int:
        d = self.cfg.tbo_delta_stages
        return overlap.delta_stages(self.decode) if d is None else d

    def observe_loads(self, counts: torch.Tensor) -> None:
        self.loads, self._own_loads = counts, False
        self._loads_at_rebalance = counts.clone()

    def _set_tables(self) -> None:
        p = self.placement
        self.identity = p.phy2log == tuple(range(p.num_logical))   # v0.4's layout: physical ids = logical ids
        self.log2phy, self.replica_count = p.tables(self.w13.device)

    # -- EPLB -------------------------------------------------------------------------------------------------
    def rebalance(self) -> None:
        """Place the slots anew from the loads recorded since the last rebalance and fetch the experts this rank
        lacks (a collective: every rank calls it at the same forward)."""
        base = self._loads_at_rebalance
        window = torch.where(self.loads >= base, self.loads - base, self.loads)   # counts reset since: all of them
        self._loads_at_rebalance = self.loads.clone()
        if self.token_layout == "local" and self.group.size > 1:   # each rank recorded its own tokens
            window = self.group.all_reduce(window.to(self.group.device))
        e = self.cfg.eplb
        old = self.placement
        new = Placement(tuple(rebalance([float(x) for x in window.tolist()], old.num_physical, e.num_groups,
                                        e.num_nodes, self.group.size, e.policy)), old.num_logical, old.size)
        self._move_to(new)

    def _move_to(self, new: Placement) -> None:
        old, rank, group = self.placement, self.group.rank, self.group
        moves = old.moves(new)
        local_old = {old.phy2log[s]: i for i, s in enumerate(old.local_slots(rank))}
        inter, hidden = self.w2.shape[2], self.w2.shape[1]
        sends = [(e, dst) for e, src, dst in moves if src == rank]
        rows = torch.stack([torch.cat([self.w13[local_old[e]].reshape(-1), self.w2[local_old[e]].reshape(-1)])
                            for e, _ in sends]) if sends else self.w13.new_empty(0, 3 * inter * hidden)
        send_counts = [sum(1 for _, d in sends if d == r) for r in range(group.size)]
        recv_from = [[e for e, src, dst in moves if dst == rank and src == r] for r in range(group.size)]
        got, _ = group.all_to_all_uneven(rows, send_counts, recv_counts=[len(x) for x in recv_from])
        received = {e: got[i] for i, e in enumerate(e for experts in recv_from for e in experts)}
        w13, w2 = [], []
        for s in new.local_slots(rank):
            e = new.phy2log[s]
            if e in local_old:
                w13.append(self.w13[local_old[e]])
                w2.append(self.w2[local_old[e]])
            else:
                w13.append(received[e][:2 * inter * hidden].view(2 * inter, hidden))
                w2.append(received[e][2 * inter * hidden:].view(hidden, inter))
        self.w13, self.w2 = torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
        self.placement, self.first = new, new.local_slots(rank).start
        self._set_tables()
        self.stats["eplb_rebalances"] += 1
        self.stats["eplb_experts_moved"] += len(moves)
        self.stats["eplb_bytes_moved"] += len(moves) * rows.shape[1] * self.w13.element_size() if moves else 0

    # -- forward ----------------------------------------------------------------------------------------------
    def _local_experts(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """Sum over this rank's slots only (ids are physical slots); other ranks' slots contribute zero."""
        mine = (topk_ids >= self.first) & (topk_ids < self.first + self.experts_per_rank)
        self.slots_computed += mine.sum()   # a device counter: no host sync
        return self.fused_moe(hidden, self.w13, self.w2, topk_ids, topk_weights, expert_offset=self.first,
                              device_name=self.device_name)

    def forward(self, hidden, topk_ids, topk_weights):
        every = self.cfg.eplb.rebalance_every
        if every and self.forwards and self.forwards % every == 0:
            self.rebalance()
        self.forwards += 1
        if self._own_loads:   # a backend built without its layer records its own loads
            self.loads.index_add_(0, topk_ids.reshape(-1).long(), torch.ones_like(topk_ids.reshape(-1).long()))
        if not self.identity:   # all ranks see the same tokens under "all": the same replicas, from 0
            start = self.group.rank if self.token_layout == "local" else 0
            topk_ids = physical_ids(topk_ids, self.log2phy, self.replica_count, start)
        if self.cfg.dispatch == Dispatch.all_reduce or self.group.size == 1:
            return self._local_experts(hidden, topk_ids, topk_weights)
        if self.cfg.tbo:
            a = overlap.split_rows(hidden.shape[0])
            inputs = ((hidden[:a], topk_ids[:a], topk_weights[:a]), (hidden[a:], topk_ids[a:], topk_weights[a:]))
            stages = (self._dispatch, self._experts, self._combine)
            return torch.cat(overlap.run_overlapped(stages, inputs, self.tbo_delta()))
        return self._combine(self._experts(self._dispatch((hidden, topk_ids, topk_weights))))

    # The all-to-all in three stages; each launches its collective and returns, the next waits on it.
    def _dispatch(self, state):
        """One (token, destination rank) pair per rank owning any of the token's experts, ordered by destination;
        launches the rows' trip to their ranks."""
        hidden, topk_ids, topk_weights = state
        group, num_tokens = self.group, topk_ids.shape[0]
        owner = topk_ids.long() // self.experts_per_rank
        wanted = torch.zeros(group.size, num_tokens, dtype=torch.uint8, device=hidden.device)
        wanted[owner, torch.arange(num_tokens, device=hidden.device)[:, None]] = 1
        # all_to_all_single takes its split sizes on the host: this read and the count exchange are the layer's
        # host syncs (framework.contracts.moe.count_host_syncs); the pair list below is sized from it.
        send_counts = wanted.sum(dim=1).tolist()
        pairs = torch.argsort(wanted.view(-1), descending=True, stable=True)[:sum(send_counts)]
        token = pairs % num_tokens   # destination-major: pair i*T + t goes to rank i
        recv_counts = exchange_counts(group, send_counts)
        payload = pack_rows(hidden[token], topk_ids[token], topk_weights[token])
        pending = launch_all_to_all(group, payload, send_counts, recv_counts, "ep dispatch")
        return hidden, topk_weights.dtype, topk_ids.shape[1], token, send_counts, recv_counts, pending

    def _experts(self, state):
        """This rank's experts on the rows it received; launches their trip back."""
        hidden, weight_dtype, top_k, token, send_counts, recv_counts, pending = state
        recv_hidden, recv_ids, recv_weights = unpack_rows(pending.wait(), hidden.dtype, hidden.shape[1], top_k)
        expert_out = self._local_experts(recv_hidden, recv_ids, recv_weights.to(weight_dtype))
        back = launch_all_to_all(self.group, expert_out, recv_counts, send_counts, "ep combine")
        return hidden, token, back

    def _combine(self, state):
        """The rows back, summed per token."""
        hidden, token, back = state
        out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, token, back.wait().float()).to(hidden.dtype)
