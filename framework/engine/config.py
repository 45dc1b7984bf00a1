from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    mem_budget_mb: float = 72.0           # per rank, weights + KV (SGLang's static memory): KV = budget - weights
    kv_budget_mb: Optional[float] = None  # set: the KV pool per rank is exactly this, whatever the weights
    chunked_prefill_tokens: int = 512      # extend tokens per step; a longer prompt is prefilled in chunks
    max_running_requests: int = 256
    schedule_policy: str = "lpm"          # fcfs | lpm (longest prefix match first)
    radix_cache: bool = True
    new_token_ratio: float = 0.7          # share of running requests' future tokens reserved at admission...
    min_new_token_ratio: float = 0.1      # ...decaying per decode step toward this floor...
    new_token_ratio_decay: float = 0.001  # ...by this much (SGLang's schedule policy, PR #2096)
    device: str = "auto"                  # auto | cpu | cuda

    def validate(self) -> None:
        problems = []
        if self.mem_budget_mb <= 0:
            problems.append(f"engine.mem_budget_mb must be > 0, got {self.mem_budget_mb}")
        if self.kv_budget_mb is not None and self.kv_budget_mb <= 0:
            problems.append(f"engine.kv_budget_mb must be > 0 (or null: KV = mem_budget_mb - weights), "
                            f"got {self.kv_budget_mb}")
        if self.chunked_prefill_tokens < 1:
            problems.append(f"engine.chunked_prefill_tokens must be >= 1, got {self.chunked_prefill_tokens}")
        if self.max_running_requests < 1:
            problems.append(f"engine.max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            problems.append(f"engine.schedule_policy={self.schedule_policy!r} is not one of fcfs, lpm")
        if not 0 <= self.min_new_token_ratio <= self.new_token_ratio <= 1:
            problems.append("need 0 <= engine.min_new_token_ratio <= engine.new_token_ratio <= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"engine.device={self.device!r} is not one of auto, cpu, cuda")
        if problems:
            raise ValueError("; ".join(problems))
