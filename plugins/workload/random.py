"""workload=random: SGLang bench_serving's `random` dataset. Each request's input and output lengths are drawn
uniformly from [len * range_ratio, len] (at least 1), its prompt is random characters (no two prompts share more than
a chance prefix, as SGLang's random token ids), and every request is one session."""
from __future__ import annotations

import string
from dataclasses import dataclass

from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig

ALPHABET = string.ascii_letters + string.digits + " "


@dataclass
class RandomConfig(WorkloadConfig):
    name: str = "random"
    num_prompts: int = 64
    input_len: int = 256            # characters (= tokens with the byte tokenizer)
    output_len: int = 32
    range_ratio: float = 0.0        # lengths uniform in [len * range_ratio, len]; 1.0 = exactly len
    # the server adds the tokenizer's BOS before every prompt (SGLang with DeepSeek's and Llama's tokenizers): one
    # more prompt token, shared by every prompt. mode=sim honours it (framework/sim/cluster.py); off by default so
    # the real and simulated CPU runs (experiments/sim_fidelity) see the same prompts
    bos: bool = False


@WORKLOAD.register("random")
class RandomWorkload(Workload):
    Config = RandomConfig
    sized_by = ("num_prompts",)

    def generate(self) -> list[Session]:
        c, rng = self.cfg, self.rng
        problems = [f"workload.{k}={getattr(c, k)} must be >= 1" for k in ("num_prompts", "input_len", "output_len")
                    if getattr(c, k) < 1]
        if not 0.0 <= c.range_ratio <= 1.0:
            problems.append(f"workload.range_ratio={c.range_ratio} must be in [0, 1]")
        if problems:
            raise ValueError("; ".join(problems))

        def length(n: int) -> int:
            return rng.randint(max(int(n * c.range_ratio), 1), n)
        return [Session(f"random-{i}", 0.0, [Turn("".join(rng.choices(ALPHABET, k=length(c.input_len))),
                                                   length(c.output_len))], carry_history=False)
                for i in range(c.num_prompts)]
