"""What one forward pass computes: the forward mode and the tensors the model reads.

A request's KV slots are not copied into the batch: attention reads them through the req_to_token table (its row
`req_pool_indices[i]`, its first `seq_lens[i]` entries, this step's tokens included). The scheduler fills the CPU
lists; `to(device)` makes the tensors the model reads.
"""
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


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    reqs: list = field(default_factory=list)
    input_ids: torch.Tensor = field(default_factory=_empty)       # [T]
    positions: torch.Tensor = field(default_factory=_empty)       # [T]
    out_cache_loc: torch.Tensor = field(default_factory=_empty)   # [T] the KV slots this step's tokens write
    req_to_token: torch.Tensor | None = None                      # the table the slots are read through
    req_pool_indices_cpu: list[int] = field(default_factory=list)  # [B] each request's row
    seq_lens_cpu: list[int] = field(default_factory=list)         # [B] tokens with KV after this step
    prefix_lens: list[int] = field(default_factory=list)          # [B] tokens already in the cache (extend)
    extend_lens: list[int] = field(default_factory=list)          # [B] new tokens per request (decode: all 1)
    sample: list[bool] = field(default_factory=list)              # False for a prefill chunk that is not the last
    return_all_logits: bool = False
    kv_width: int | None = None        # decode: slots each row's attention reads (None: the longest context;
                                       # a captured graph's is fixed, framework/engine/cuda_graph.py)
    # device tensors, made by to(); the attention metadata, made once per forward by the model
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    attn_metadata: object = None
    row_mask: torch.Tensor | None = None   # [T] 0 for a captured graph's padding rows (None: every row is real)
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
        for name in ("input_ids", "positions", "out_cache_loc"):     # long: every index the model uses
            setattr(self, name, getattr(self, name).to(device, dtype=torch.long, non_blocking=True))
        self.req_pool_indices = torch.tensor(self.req_pool_indices_cpu, dtype=torch.long).to(device, non_blocking=True)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.long).to(device, non_blocking=True)
        return self
