"""workload=shared_prefix: SGLang's generated-shared-prefix benchmark (bench_serving `generated-shared-prefix`).

`num_groups` system prompts, each followed by `prompts_per_group` different questions; every prompt is one request.
The requests are shuffled (as SGLang does), so consecutive requests belong to different groups and a round-robin
router scatters each group over every worker, while a cache-aware one keeps a group where its prefix is cached.
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig, random_text


@dataclass
class SharedPrefixConfig(WorkloadConfig):
    name: str = "shared_prefix"
    num_groups: int = 16
    prompts_per_group: int = 8
    system_prompt_len: int = 256      # characters (= tokens with the byte tokenizer), shared within a group
    question_len: int = 32            # characters of each request's own question
    output_len: int = 16              # tokens generated per request
    shuffle: bool = True              # False: group after group (a best case for any router)
    # the server adds the tokenizer's BOS before every prompt (SGLang with DeepSeek's and Llama's tokenizers): one
    # more prompt token, shared by every prompt. mode=sim honours it (framework/sim/cluster.py); off by default so
    # the real and simulated CPU runs (experiments/sim_fidelity) see the same prompts
    bos: bool = False


@WORKLOAD.register("shared_prefix")
class SharedPrefix(Workload):
    Config = SharedPrefixConfig
    sized_by = ("num_groups", "prompts_per_group")

    def generate(self) -> list[Session]:
        c, rng = self.cfg, self.rng
        problems = [f"workload.{k}={getattr(c, k)} must be >= 1" for k in
                    ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len")
                    if getattr(c, k) < 1]
        if problems:
            raise ValueError("; ".join(problems))
        sessions = []
        for g in range(c.num_groups):
            # the group number leads the prompt, so two groups share at most a few characters by chance
            system = (f"System {g}: " + random_text(rng, c.system_prompt_len + 1))[:c.system_prompt_len]
            for i in range(c.prompts_per_group):
                question = random_text(rng, c.question_len + 1)[:c.question_len]   # random_text may end 1 short
                sessions.append(Session(f"group-{g}-{i}", 0.0, [Turn(question, c.output_len)], prefix=system + "\n\n",
                                        carry_history=False))
        if c.shuffle:
            rng.shuffle(sessions)
        return sessions
