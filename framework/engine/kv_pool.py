"""A token-level KV pool: one row per token slot, per layer: the MLA latent plus the RoPE key."""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, width: int, capacity: int, dtype: torch.dtype, device="cpu"):
        if capacity < 1:
            raise ValueError(f"the KV pool holds no token (capacity {capacity}); raise engine.kv_budget_mb")
        self.capacity = capacity
        self.buffer = torch.zeros(num_layers, capacity, width, dtype=dtype, device=device)
        self._free = torch.arange(capacity, dtype=torch.long)

    def layer(self, i: int) -> torch.Tensor:
        return self.buffer[i]

    def available(self) -> int:
        return int(self._free.shape[0])

    def used(self) -> int:
        return self.capacity - self.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when there are not enough (the caller evicts, waits or retracts)."""
        if n > self._free.shape[0]:
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(torch.long).cpu()])
