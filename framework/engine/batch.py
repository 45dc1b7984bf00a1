"""What one forward pass computes: the forward mode and the tensors the model reads."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill (or a prefill chunk) of new tokens, on top of any cached prefix
    DECODE = "decode"   # one token per running request
    IDLE = "idle"       # no tokens: a rank with nothing to do joins the collectives of a step the others run

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


@dataclass
class ForwardBatch:
    mode: ForwardMode
    reqs: list = field(default_factory=list)
    input_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    out_cache_loc: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    extend_lens: list[int] = field(default_factory=list)        # new tokens per request (decode: all 1)
    kv_slots: list[torch.Tensor] = field(default_factory=list)  # extend: each request's slots, prefix + new
    padded_slots: torch.Tensor | None = None                    # decode: [B, Lmax] slots (0 where padded)
    padded_mask: torch.Tensor | None = None                     # decode: [B, Lmax] True where valid
    sample: list[bool] = field(default_factory=list)            # False for a prefill chunk that is not the last
    return_all_logits: bool = False
    # filled by the parallelism plugin's per-step sync (DP attention)
    global_num_tokens: list[int] | None = None
    can_run_graph: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_index(self) -> torch.Tensor:
        return torch.tensor(self.extend_lens, dtype=torch.long).cumsum(0) - 1

    @classmethod
    def idle(cls) -> "ForwardBatch":
        return cls(ForwardMode.IDLE)

    def to(self, device) -> "ForwardBatch":
        for name in ("input_ids", "positions", "out_cache_loc", "padded_slots", "padded_mask"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))
        self.kv_slots = [s.to(device, non_blocking=True) for s in self.kv_slots]
        return self
