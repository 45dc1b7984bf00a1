"""workload=sharegpt: conversations from a ShareGPT-format file, sampled as SGLang's bench_serving samples them.

The file is a JSON list (or JSONL; plain or .gz) of `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`. As SGLang's `sample_sharegpt_requests`: conversations with fewer than 2
messages are dropped, the rest shuffled (by `seed`); a request is the first message as the prompt and the second's
length as the output length (`output_len` fixes it instead); a pair is skipped when either side is under 4 tokens,
the prompt over `max_prompt_len`, or, without a fixed output length, prompt + output over `max_total_len`.
`multi_turn=true` keeps every human/gpt exchange of a conversation instead, as one session whose prompts carry the
history. Tokens are the byte tokenizer's (UTF-8 bytes); `output_scale` and `max_output_len` shrink the answers for a
CPU. The repository ships a small synthetic file in this format (data/sharegpt/); the real dataset is
`anon8231489123/ShareGPT_Vicuna_unfiltered` on Hugging Face (ShareGPT_V3_unfiltered_cleaned_split.json).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from framework.core.errors import UserError
from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig, open_text, resolve_data_path

DEFAULT_PATH = "data/sharegpt/synthetic_sharegpt.json.gz"
MIN_LEN = 4                       # SGLang drops pairs with fewer tokens on either side


@dataclass
class ShareGPTConfig(WorkloadConfig):
    name: str = "sharegpt"
    path: str = DEFAULT_PATH          # absolute, or relative to the working directory or else to the repo
    num_prompts: int = 64             # sessions to sample; 0 = every usable conversation
    output_len: int = 0               # fixed output length; 0 = the reply's length
    max_prompt_len: int = 1024        # SGLang's filters (tokens)
    max_total_len: int = 2048
    output_scale: float = 1.0         # reply lengths are multiplied by this...
    max_output_len: int = 0           # ...and capped at this (0: no cap)
    multi_turn: bool = False          # every exchange of a conversation, history carried (SGLang: the first only)


def _tokens(text: str) -> int:
    return len(text.encode("utf-8"))


def load_conversations(path: str) -> list[list[str]]:
    """Every conversation's message texts, in file order; errors name the file and the entry."""
    where = resolve_data_path(path, f"The repository ships {DEFAULT_PATH} (synthetic); point workload.path at a "
                                    "ShareGPT-format JSON list or JSONL (plain or .gz)")
    with open_text(where) as f:
        raw = f.read()
    try:
        lines = [] if raw.lstrip().startswith("[") else [line for line in raw.splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines] if lines else json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON or JSONL ({e.msg} at line {e.lineno})") from None
    out = []
    for i, row in enumerate(rows):
        conv = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(conv, list) or not all(isinstance(m, dict) and isinstance(m.get("value"), str) for m in conv):
            raise ValueError(f"{where}: entry {i} is not "
                             f"{{'conversations': [{{'from': ..., 'value': <string>}}, ...]}}")
        out.append([m["value"] for m in conv])
    return out


@WORKLOAD.register("sharegpt")
class ShareGPT(Workload):
    Config = ShareGPTConfig
    sized_by = ("num_prompts",)

    def output_len(self, reply: str) -> int:
        c = self.cfg
        n = c.output_len or max(1, round(_tokens(reply) * c.output_scale))
        return min(n, c.max_output_len) if c.max_output_len else n

    def keep(self, prompt: str, reply: str) -> bool:
        c, n_in, n_out = self.cfg, _tokens(prompt), _tokens(reply)
        if n_in < MIN_LEN or (n_out < MIN_LEN and not c.output_len):
            return False
        return n_in <= c.max_prompt_len and (bool(c.output_len) or n_in + n_out <= c.max_total_len)

    def generate(self) -> list[Session]:
        c = self.cfg
        if c.num_prompts < 0 or c.output_len < 0 or c.output_scale <= 0 or c.max_output_len < 0:
            raise ValueError("workload.num_prompts, output_len and max_output_len must be >= 0 and output_scale > 0")
        convs = [m for m in load_conversations(c.path) if len(m) >= 2]
        self.rng.shuffle(convs)
        sessions = []
        for messages in convs:
            if c.num_prompts and len(sessions) == c.num_prompts:
                break
            pairs = list(zip(messages[0::2], messages[1::2])) if c.multi_turn else [tuple(messages[:2])]
            if c.multi_turn:   # keep the exchanges up to the first that fails a filter (each needs the earlier ones)
                kept = next((i for i, p in enumerate(pairs) if not self.keep(*p)), len(pairs))
                pairs = pairs[:kept]
            elif not self.keep(*pairs[0]):
                continue
            if pairs:
                sessions.append(Session(f"sharegpt-{len(sessions)}", 0.0,
                                        [Turn(p, self.output_len(r)) for p, r in pairs], carry_history=c.multi_turn))
        if not sessions:
            raise ValueError(f"workload.path={c.path!r}: no conversation passes the filters (>= {MIN_LEN} tokens a "
                             f"side, prompt <= max_prompt_len={c.max_prompt_len}, prompt + output <= "
                             f"max_total_len={c.max_total_len})")
        if len(sessions) < c.num_prompts:   # SGLang samples fewer without a word; a run here says so
            raise UserError(f"workload.num_prompts={c.num_prompts} asks for more conversations than "
                            f"workload.path={c.path!r} has passing the filters ({len(sessions)}); set "
                            f"workload.num_prompts to at most {len(sessions)} (0: all of them)")
        return sessions
