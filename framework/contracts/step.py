"""What the DP groups of an instance tell each other before each step: one `StepBid` per group (SGLang v0.4's
`prepare_dp_attn_batch` exchange: token counts and "decode or idle", plus the running requests for the instance's
peak). The parallelism plugin's `sync_step` carries the bids between ranks; the step that decides from them is
framework/engine/step.py, the same on the ranks and in the simulator."""
from __future__ import annotations

from typing import NamedTuple


class StepBid(NamedTuple):
    tokens: int          # tokens the group's batch runs (decode: one per request; no batch: 0)
    graphable: bool      # decode or no batch: the step may replay a CUDA graph only when every group's is
    running: int         # requests running in the group as its batch forms (the instance's peak sums them)
