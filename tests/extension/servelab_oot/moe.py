"""moe=strided_ep: expert parallelism with experts dealt round-robin over the ranks (rank r owns the experts e with
(e + moe.offset) % size == r), so any expert count splits over any size, where the built-in ep needs blocks of equal
size. Every rank sees every token (layout "all"), computes its own experts with the reference loop and returns a
partial sum, which the parallelism plugin's all-reduce completes (the shared experts are sliced to match)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.contracts.moe import MoEBackend, MoEConfig, routed_expert_bytes
from framework.core.registry import MOE
from framework.model.reference import experts_reference


@dataclass
class StridedEPConfig(MoEConfig):
    name: str = "strided_ep"
    offset: int = 0              # rotates the deal: rank r owns experts e with (e + offset) % size == r


def owned_experts(num_experts: int, offset: int, rank: int, size: int) -> list[int]:
    return [e for e in range(num_experts) if (e + offset) % size == rank]


@MOE.register("strided_ep")
class StridedEP(MoEBackend):
    Config = StridedEPConfig
    token_layout, partial = "all", True

    def __init__(self, cfg: StridedEPConfig, w13: torch.Tensor, w2: torch.Tensor, group) -> None:
        super().__init__(cfg, w13, w2, group)
        mine = owned_experts(w13.shape[0], cfg.offset, group.rank, group.size)
        self.w13, self.w2 = w13[mine].contiguous(), w2[mine].contiguous()
        self.local_id = torch.full((w13.shape[0],), -1, dtype=torch.long)   # global expert id -> local, -1: not mine
        self.local_id[mine] = torch.arange(len(mine))

    @classmethod
    def weight_bytes(cls, cfg, model_cfg, rank: int, size: int) -> int:
        return routed_expert_bytes(model_cfg, len(owned_experts(model_cfg.n_routed_experts, cfg.offset, rank, size)))

    @classmethod
    def expert_split(cls, cfg, size: int) -> tuple[int, int]:
        return size, 1

    def forward(self, hidden, topk_ids, topk_weights):
        local = self.local_id.to(topk_ids.device)[topk_ids]      # other ranks' experts: -1, matched by no local id
        return experts_reference(hidden, self.w13, self.w2, local, topk_weights)
