"""Requests, their sampling parameters and their life cycle on one rank."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

_ids = itertools.count()
_NO_SLOTS = torch.empty(0, dtype=torch.int32)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0      # 0: greedy
    top_p: float = 1.0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(eq=False)
class Req:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    # KV state (SGLang's Req): the row of the req_to_token table holding this request's slots (0: none), how many
    # tokens have KV there, the leading ones the radix cache owns (locked through last_node), this round's extend
    extend_input_len: int = 0
    req_pool_idx: int = 0
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: _NO_SLOTS)
    last_node: object = None
    cached_tokens: int = -1        # prompt tokens found in the radix cache at first admission (-1: not yet admitted)
    finish_reason: str | None = None
    first_token_time: float | None = None
    # seconds from arrival_time to the first token as its engine's scheduler stamped it (after the step that sampled
    # it); an instance client's copy takes the rank's, its own first_token_time being when the token reached it
    engine_ttft_s: float | None = None
    finish_time: float | None = None
    retractions: int = 0
    text_tail: str = ""           # decoded output tail, for stop strings
    # prefill/decode disaggregation: the pairing (framework.engine.disagg.Pairing; None on a mixed instance) and
    # what the KV transfer moved (the decode side's figures: bytes received, seconds from the room's pairing)
    pairing: object = None
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0

    @property
    def fill_ids(self) -> list[int]:
        """Every token that must be in the KV cache before the next token can be sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def release_kv(self) -> None:
        """Forget the KV state (its slots went back to the pool or into the radix cache)."""
        self.req_pool_idx = self.kv_len = self.extend_input_len = 0
        self.prefix_indices, self.last_node = _NO_SLOTS, None

    def check_finished(self, eos_id: int, decode_tail) -> None:
        """SGLang's order: the length limit first, then EOS, then stop strings."""
        if len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        elif not self.params.ignore_eos and self.output_ids[-1] == eos_id:
            self.finish_reason = "stop"
        elif self.params.stop:
            self.text_tail = (self.text_tail + decode_tail(self.output_ids[-1:]))[-256:]
            if any(s in self.text_tail for s in self.params.stop):
                self.finish_reason = "stop"
