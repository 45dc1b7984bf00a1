"""workload=fixed_prompts: the same prompts in every run, one single-turn session each, in the order given (a
regression set: results compare across runs and seeds)."""
from __future__ import annotations

from dataclasses import dataclass, field

from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig
from framework.core.registry import WORKLOAD

PROMPTS = ("The capital of France is", "A radix tree stores", "Expert parallelism splits",
           "Decode is memory-bound because", "Prefill and decode on separate instances")


@dataclass
class FixedPromptsConfig(WorkloadConfig):
    name: str = "fixed_prompts"
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    output_len: int = 8


@WORKLOAD.register("fixed_prompts")
class FixedPrompts(Workload):
    Config = FixedPromptsConfig
    sized_by = ("prompts",)      # one request per prompt: workload.num_requests caps them

    def generate(self) -> list[Session]:
        if not self.cfg.prompts or self.cfg.output_len < 1:
            raise ValueError(f"workload=fixed_prompts needs prompts and workload.output_len >= 1, got "
                             f"{len(self.cfg.prompts)} prompts and output_len={self.cfg.output_len}")
        return [Session(f"fixed-{i}", 0.0, [Turn(text, self.cfg.output_len)], carry_history=False)
                for i, text in enumerate(self.cfg.prompts)]
