"""What a workload is: sessions of turns, arriving over time. Generators (framework/workload/generators/, the
`workload=` registry) build them; a load client (in-process or over HTTP) plays them."""
from __future__ import annotations

import enum
import gzip
import random
from dataclasses import dataclass, field
from pathlib import Path

from framework.core.errors import UserError
from framework.core.paths import REPO_ROOT


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

    def messages(self, k: int, answers: list[str]) -> list[dict]:
        """Turn k as OpenAI chat messages: the prefix as the system message, then (multi-turn) every earlier turn
        and its answer."""
        msgs = [{"role": "system", "content": self.prefix}] if self.prefix else []
        if self.carry_history:
            for i in range(k):
                msgs += [{"role": "user", "content": self.turns[i].text}, {"role": "assistant", "content": answers[i]}]
        return msgs + [{"role": "user", "content": self.turns[k].text}]


class Api(enum.Enum):
    """The client API the load generator speaks (streaming, always)."""
    generate = "generate"           # SGLang native POST /generate
    completions = "completions"     # OpenAI POST /v1/completions
    chat = "chat"                   # OpenAI POST /v1/chat/completions


@dataclass
class SloConfig:
    """Service-level objectives for goodput (vLLM's definition); 0 = not set."""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0


@dataclass
class WorkloadConfig:
    name: str = ""                     # the plugin's key: each plugin's Config names itself
    num_requests: int = 0              # cap on requests (turns) in all; 0 = no cap
    request_rate: float = 0.0          # sessions per second; 0 = all at once (SGLang/vLLM: inf)
    burstiness: float = 1.0            # gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier
    max_concurrency: int = 0           # requests in flight at once (bench_serving's --max-concurrency); 0 = unlimited
    ignore_eos: bool = True            # random weights say EOS at random: keep lengths as asked
    temperature: float = 0.0
    api: Api = Api.generate            # HTTP client API: generate | completions | chat
    model: str = ""                    # OpenAI "model" field; "" = the first id of the server's GET /v1/models
    slo: SloConfig = field(default_factory=SloConfig)
    sample_interval_s: float = 0.25    # how often the HTTP client samples the router's per-worker load; 0 = never
    seed: int | None = None            # the draw of prompts, lengths and arrivals; None = the run's seed (the weights
                                       # and sampling keep the run's: another draw of the same workload on one model)


def check_arrivals(cfg: WorkloadConfig) -> None:
    problems = [f"workload.{k}={getattr(cfg, k)} must be >= 0" for k in
                ("num_requests", "request_rate", "max_concurrency", "sample_interval_s") if getattr(cfg, k) < 0]
    if cfg.burstiness <= 0:
        problems.append(f"workload.burstiness={cfg.burstiness} must be > 0 (1 = Poisson arrivals)")
    if problems:
        raise ValueError("; ".join(problems))


class Workload:
    Config = WorkloadConfig
    timed = False   # True: generate() sets arrival times itself (trace replay); else request_rate assigns them
    sized_by: tuple[str, ...] = ()   # the Config fields that set how many requests it makes (num_requests caps them)

    def __init__(self, cfg: WorkloadConfig, seed: int):
        seed = seed if cfg.seed is None else cfg.seed      # workload.seed: its own draw
        self.cfg, self.seed = cfg, seed
        self.rng = random.Random(seed)

    @classmethod
    def ignored_keys(cls, cfg: WorkloadConfig) -> dict[str, str]:
        """The `workload.*` fields this workload ignores with `cfg`, each with why and what to do instead: a run that
        sets one is refused at start (framework/config.py). The base: burstiness without a request rate."""
        if cfg.request_rate > 0:
            return {}
        return {"burstiness": "workload.request_rate=0 sends every session at once, and burstiness shapes the gaps "
                              "between arrivals; set workload.request_rate too, or drop workload.burstiness"}

    def sessions(self) -> list[Session]:
        """All sessions, in arrival order, capped at cfg.num_requests turns (a cap above what the workload makes is
        refused: it would run fewer requests than asked without a word)."""
        check_arrivals(self.cfg)
        sessions = self.generate()
        self.check_cap(sum(len(s.turns) for s in sessions))
        if not self.timed:
            rate, shape = self.cfg.request_rate, self.cfg.burstiness
            t = 0.0
            for s in sessions:   # the first at 0, then gamma gaps of mean 1/rate (shape 1: exponential), as SGLang
                s.arrival_s = t
                if rate > 0:
                    t += self.rng.gammavariate(shape, 1.0 / (rate * shape))
        return cap_requests(sorted(sessions, key=lambda s: s.arrival_s), self.cfg.num_requests)

    def generate(self) -> list[Session]:
        """The generator's sessions, in the order they arrive."""
        return []

    def check_cap(self, made: int) -> None:
        """Refuse a workload.num_requests above the `made` requests this workload's settings make."""
        cap = self.cfg.num_requests
        if cap <= made:
            return
        raise_size = " or ".join(f"workload.{k}" for k in self.sized_by)
        raise UserError(f"workload.num_requests={cap} asks for more requests than workload={self.cfg.name} makes with "
                        f"these settings ({made}); {f'raise {raise_size}, or ' if raise_size else ''}set "
                        f"workload.num_requests to at most {made} (0: all of them)")


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


def resolve_data_path(path: str, hint: str) -> Path:
    """A data file's path: absolute, or relative to the working directory, else to the repository root (where the
    shipped data lives, whatever directory the user runs from). A miss names where it looked, then `hint`."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(f"workload.path={path!r}: no file there (looked at "
                            f"{', '.join(str(c) for c in candidates)}). {hint}")


def open_text(path: Path):
    """Open a data file for reading text, gzip-compressed when its name ends in .gz."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")
