"""workload=multi_turn: conversations x turns behind one shared system prompt; each prompt carries the whole
conversation so far, so a cache that keeps it (and a router that sends it back to the same worker) saves the prefill."""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig, random_text


@dataclass
class MultiTurnConfig(WorkloadConfig):
    name: str = "multi_turn"
    num_conversations: int = 16
    turns: int = 4
    system_prompt_len: int = 256      # characters (= tokens with the byte tokenizer)
    user_len: int = 48
    output_len: int = 24
    length_jitter: float = 0.25       # per-turn lengths vary uniformly by +-25%
    think_time_s: float = 0.0


@WORKLOAD.register("multi_turn")
class MultiTurn(Workload):
    Config = MultiTurnConfig
    sized_by = ("num_conversations", "turns")

    def generate(self) -> list[Session]:
        c, rng = self.cfg, self.rng
        system = "System: " + random_text(rng, c.system_prompt_len) + "\n"

        def jitter(n: int) -> int:
            return max(1, round(n * rng.uniform(1 - c.length_jitter, 1 + c.length_jitter)))
        sessions = []
        for i in range(c.num_conversations):
            turns = [Turn(f"\nUser: {random_text(rng, jitter(c.user_len))}\nAssistant:", jitter(c.output_len),
                          c.think_time_s if k else 0.0) for k in range(c.turns)]
            sessions.append(Session(f"conv-{i}", 0.0, turns, prefix=system))
        return sessions
