"""Where one MoE layer's experts live under expert parallelism, and which replica a token's expert goes to.

A `Placement` is `phy2log` (physical slot s holds logical expert phy2log[s]) over `size` ranks: rank r holds the
consecutive slots [r * P / size, (r + 1) * P / size). With P = E slots in order it is SGLang v0.4's moe=ep (rank r:
the r-th block of experts); with P > E some experts have several replicas ("redundant experts", DeepSeek-V3).

Dispatch (`physical_ids`): each chosen logical expert goes to one of its replicas, the least-loaded one as the slots
of this step fill them: a rank hands the n-th slot for expert e in its batch to replica (n + rank) mod count(e), so
replicas fill evenly whatever the rank's batch and ranks start on different replicas. Every replica holds the same
weights, so the choice changes where work runs, never the result.

A cost model reads the same object: `rank_loads(expert_loads)` is what each rank computes for given logical loads.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    phy2log: tuple[int, ...]
    num_logical: int
    size: int

    def __post_init__(self):
        if len(self.phy2log) % self.size:
            raise ValueError(f"{len(self.phy2log)} physical expert slots do not divide over {self.size} ranks; "
                             f"choose moe.num_redundant_experts so that n_routed_experts + it divides by the size")
        missing = set(range(self.num_logical)) - set(self.phy2log)
        if missing or not all(0 <= e < self.num_logical for e in self.phy2log):
            raise ValueError(f"a placement must hold every expert 0..{self.num_logical - 1} once at least "
                             f"(missing {sorted(missing)})")

    @property
    def num_physical(self) -> int:
        return len(self.phy2log)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.size

    def local_slots(self, rank: int) -> range:
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def experts_on(self, rank: int) -> set[int]:
        return {self.phy2log[s] for s in self.local_slots(rank)}

    def replicas(self) -> list[list[int]]:
        """Logical expert -> its physical slots, in slot order."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for s, e in enumerate(self.phy2log):
            out[e].append(s)
        return out

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy [E, max replicas] padded with the first replica, replica count [E]) for `physical_ids`."""
        reps = self.replicas()
        width = max(len(r) for r in reps)
        log2phy = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.int64, device=device)
        return log2phy, torch.tensor([len(r) for r in reps], dtype=torch.int64, device=device)

    def rank_loads(self, expert_loads: list[float]) -> list[float]:
        """Each rank's share of `expert_loads` (slots per logical expert) when every expert's load splits evenly
        over its replicas: what least-loaded dispatch approaches. For cost models and the EPLB experiment."""
        count = [len(r) for r in self.replicas()]
        loads = [0.0] * self.size
        for s, e in enumerate(self.phy2log):
            loads[s // self.slots_per_rank] += expert_loads[e] / count[e]
        return loads

    def moves(self, new: "Placement") -> list[tuple[int, int, int]]:
        """(expert, from rank, to rank) for every expert a rank holds under `new` but not now, from the lowest
        rank that holds it now. Every rank derives the same list."""
        if (new.num_logical, new.size) != (self.num_logical, self.size):
            raise ValueError("a placement can only move to one of the same experts and ranks")
        holders: dict[int, int] = {}
        for s, e in enumerate(self.phy2log):
            holders.setdefault(e, s // self.slots_per_rank)
        out = []
        for rank in range(self.size):
            for e in sorted(new.experts_on(rank) - self.experts_on(rank)):
                out.append((e, holders[e], rank))
        return out


def contiguous(num_logical: int, num_physical: int, size: int) -> Placement:
    """Slot s holds expert s mod E: with no redundant slots, v0.4's blocks; extra slots replicate 0, 1, ..."""
    return Placement(tuple(s % num_logical for s in range(num_physical)), num_logical, size)


def shuffled(num_logical: int, num_physical: int, size: int, seed: int) -> Placement:
    """`contiguous`'s slots in a random order from `seed` (the same on every rank): experts anywhere."""
    slots = [s % num_logical for s in range(num_physical)]
    random.Random(seed).shuffle(slots)
    return Placement(tuple(slots), num_logical, size)


def physical_ids(topk_ids: torch.Tensor, log2phy: torch.Tensor, count: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Each (token, k) slot's physical slot: the n-th slot of logical expert e in row-major order goes to replica
    (n + start) mod count[e]. No host sync (a cumulative count per expert, computed on the device)."""
    flat = topk_ids.reshape(-1).long()
    if flat.numel() == 0:
        return topk_ids.long()
    one_hot = torch.nn.functional.one_hot(flat, log2phy.shape[0])
    nth = (one_hot.cumsum(0) - one_hot).gather(1, flat[:, None]).squeeze(1)   # earlier slots of the same expert
    replica = (nth + start) % count[flat]
    return log2phy[flat, replica].view_as(topk_ids)
