"""Requests, their sampling parameters and their life cycle on one rank."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

_ids = itertools.count()


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
    # KV state: slots holding fill_ids[:len(kv_slots)]; the first `prefix_len` belong to the radix cache (locked)
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    prefix_len: int = 0
    last_node: object = None
    cached_tokens: int = -1        # prompt tokens found in the radix cache at first admission (-1: not yet admitted)
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    retractions: int = 0
    text_tail: str = ""           # decoded output tail, for stop strings

    @property
    def fill_ids(self) -> list[int]:
        """Every token that must be in the KV cache before the next token can be sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    def check_finished(self, eos_id: int, decode_tail) -> None:
        if self.output_ids and not self.params.ignore_eos and self.output_ids[-1] == eos_id:
            self.finish_reason = "stop"
        elif self.params.stop:
            self.text_tail = (self.text_tail + decode_tail(self.output_ids[-1:]))[-256:]
            if any(s in self.text_tail for s in self.params.stop):
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
