"""What a workload is: sessions of turns, arriving over time. Generators (framework/workload/generators/, the
`workload=` registry) build them; a load client (in-process or over HTTP) plays them."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Turn:
    text: str                     # new text this turn adds (a user message, a question, a whole prompt)
    max_new_tokens: int
    think_time_s: float = 0.0     # pause after the previous answer before this turn is sent


@dataclass
class Session:
    sid: str
    arrival_s: float              # when the first turn is sent, relative to the start of the run
    turns: list[Turn]
    prefix: str = ""              # text before the first turn (a system prompt)
    carry_history: bool = True    # multi-turn: each prompt holds the whole conversation so far

    def prompt(self, k: int, answers: list[str]) -> str:
        """Turn k's request text: the prefix, then (multi-turn) every earlier turn and its answer."""
        if not self.carry_history:
            return self.prefix + self.turns[k].text
        parts = [self.prefix]
        for i in range(k):
            parts += [self.turns[i].text, answers[i]]
        parts.append(self.turns[k].text)
        return "".join(parts)


@dataclass
class WorkloadConfig:
    name: str = "multi_turn"
    num_requests: int = 0              # cap on requests (turns) in all; 0 = no cap
    request_rate: float = 0.0          # sessions per second (Poisson arrivals); 0 = all at once
    max_concurrency: int = 0           # sessions in flight at once; 0 = unlimited
    ignore_eos: bool = True            # random weights say EOS at random: keep lengths as asked
    temperature: float = 0.0


class Workload:
    Config = WorkloadConfig
    timed = False   # True: generate() sets arrival times itself (trace replay); else request_rate assigns them

    def __init__(self, cfg: WorkloadConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.rng = random.Random(seed)

    def sessions(self) -> list[Session]:
        """All sessions, in arrival order, capped at cfg.num_requests turns."""
        sessions = self.generate()
        if not self.timed:
            t = 0.0
            for s in sessions:
                if self.cfg.request_rate > 0:
                    t += self.rng.expovariate(self.cfg.request_rate)
                s.arrival_s = t
        return cap_requests(sorted(sessions, key=lambda s: s.arrival_s), self.cfg.num_requests)

    def generate(self) -> list[Session]:
        """The generator's sessions, in the order they arrive."""
        return []


def cap_requests(sessions: list[Session], cap: int) -> list[Session]:
    if cap <= 0:
        return sessions
    out, left = [], cap
    for s in sessions:
        if left <= 0:
            break
        s.turns = s.turns[:left]
        left -= len(s.turns)
        out.append(s)
    return out


_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there been one all we their has would when if so no will more cache token route "
          "expert latent batch decode prefill rank queue model serve layer head prefix tree node worker load").split()


def random_text(rng: random.Random, n_chars: int) -> str:
    """Deterministic word salad of about n_chars characters (ASCII, so characters = bytes = tokens)."""
    words, size = [], 0
    while size < n_chars:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n_chars]
