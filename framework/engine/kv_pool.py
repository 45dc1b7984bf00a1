"""The two memory pools of one rank (SGLang's mem_cache/memory_pool.py).

KVPool: token slots; each slot holds one token's KV for every layer (the MLA latent plus the RoPE key). Slot 0 is a
padding sink that is never handed out: padded rows of a batch (CUDA graphs) write there.
ReqToTokenPool: one row per running request holding the KV slots of its tokens in order, written once per token in
place; attention reads a request's slots through its row. Row 0 is a padding row that is never handed out.

The simulator's twins (`CountingKVPool`, `CountingReqToTokenPool`) keep the same accounting with nothing allocated:
their slots are `SlotCount`s, a length without slot ids, which the scheduler and the radix cache handle like a slot
tensor (len, slicing, clone, concatenation through `cat_slots`).
"""
from __future__ import annotations

import torch

SLOT_DTYPE = torch.int32


class KVPool:
    holds_kv = True  # a forward reads and writes it: the scheduler builds each batch's input tensors

    def __init__(self, num_layers: int, width: int, capacity: int, dtype: torch.dtype, device="cpu"):
        if capacity < 1:
            raise ValueError(f"the KV pool holds no token (capacity {capacity}); raise engine.kv_budget_mb")
        self.capacity = capacity
        self.device = torch.device(device)
        self.buffer = torch.zeros(num_layers, capacity + 1, width, dtype=dtype, device=device)
        self._free = torch.arange(1, capacity + 1, dtype=SLOT_DTYPE)     # on the CPU, as SGLang keeps it

    def layer(self, i: int) -> torch.Tensor:
        return self.buffer[i]

    def available(self) -> int:
        return int(self._free.shape[0])

    def used(self) -> int:
        return self.capacity - self.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (on the pool's device), or None when there are not enough (the caller evicts first)."""
        if n > self._free.shape[0]:
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots.to(self.device, non_blocking=True)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(device="cpu", dtype=SLOT_DTYPE)])


    def req_to_token_pool(self, rows: int, context_len: int) -> "ReqToTokenPool":
        """The req_to_token table that goes with this pool."""
        return ReqToTokenPool(rows, context_len, self.device)


class ReqToTokenPool:
    def __init__(self, rows: int, context_len: int, device="cpu"):
        self.context_len = context_len
        self.table = torch.zeros(rows + 1, context_len, dtype=SLOT_DTYPE, device=device)
        self._free = list(range(rows, 0, -1))          # pop() hands out row 1 first

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("req_to_token pool exhausted: more running requests than engine.max_running_requests")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.shape[0]] = slots.to(SLOT_DTYPE)

    def write_tokens(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """slots[i] at (rows[i], positions[i]): one scatter into the flat table (a decode step's new tokens)."""
        width = self.table.shape[1]
        flat = torch.tensor([r * width + p for r, p in zip(rows, positions)], device=self.table.device)
        self.table.view(-1)[flat] = slots.to(SLOT_DTYPE)

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """A view of row's slots [start, end)."""
        return self.table[row, start:end]


class SlotCount:
    """`n` KV slots, counted but not named: what the counting pools hand out. It answers what the scheduler and the
    radix cache ask of a slot tensor (len, shape, numel, slicing, clone, to)."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def numel(self) -> int:
        return self.n

    def __getitem__(self, cut: slice) -> "SlotCount":
        start, stop, step = cut.indices(self.n)
        if step != 1:
            raise ValueError("counted slots are sliced with step 1 only")
        return SlotCount(stop - start if stop > start else 0)

    def clone(self) -> "SlotCount":
        return self

    def to(self, *args, **kwargs) -> "SlotCount":
        return self

    def __repr__(self) -> str:
        return f"SlotCount({self.n})"


def cat_slots(parts: list) -> "torch.Tensor | SlotCount":
    """Concatenate slot tensors, or add up counted slots."""
    if isinstance(parts[0], SlotCount):
        return SlotCount(sum(p.n for p in parts))
    return torch.cat(parts)


class CountingKVPool:
    """KVPool's accounting without the KV: free slots are a count and slots are `SlotCount`s (the simulator sizes a
    DeepSeek rank's pool this way without allocating it)."""

    device = torch.device("cpu")
    holds_kv = False  # no forward runs on it: the scheduler leaves a batch's input tensors empty

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the KV pool holds no token (capacity {capacity}); raise engine.kv_budget_mb")
        self.capacity = capacity
        self._available = capacity

    def available(self) -> int:
        return self._available

    def used(self) -> int:
        return self.capacity - self._available

    def alloc(self, n: int) -> SlotCount | None:
        if n > self._available:
            return None
        self._available -= n
        return SlotCount(n)

    def free(self, slots: SlotCount) -> None:
        self._available += len(slots)

    def req_to_token_pool(self, rows: int, context_len: int) -> "CountingReqToTokenPool":
        return CountingReqToTokenPool(rows)


class CountingReqToTokenPool(ReqToTokenPool):
    """ReqToTokenPool's rows without the table: a request's slots [start, end) are end - start counted slots."""

    def __init__(self, rows: int):
        self.context_len, self.table = None, None
        self._free = list(range(rows, 0, -1))

    def write(self, row: int, start: int, slots) -> None:
        pass

    def write_tokens(self, rows: list[int], positions: list[int], slots) -> None:
        pass

    def slots(self, row: int, end: int, start: int = 0) -> SlotCount:
        return SlotCount(max(0, end - start))
