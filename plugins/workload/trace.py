"""workload=trace: replay a Mooncake-format request trace (FAST'25 release).

One JSON object a line: `timestamp` (ms since the trace began), `input_length` and `output_length` (tokens), and
`hash_ids`: one id per 512-token block of the prompt, equal ids meaning equal content (the ids chain, so equal ids at
the same position mean an equal prefix). Each id becomes a fixed block of text seeded by the id, so requests that
share ids share text and a prefix cache sees the trace's real reuse; the last block is cut to the input length.

To fit a CPU, `block_tokens` shrinks every block (32 characters instead of 512 keeps the reuse pattern at 1/16 the
size), `output_scale` and `max_output_len` shrink the answers, `time_scale` speeds up the clock and
`workload.num_requests` keeps the first N requests.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from framework.core.registry import WORKLOAD
from framework.contracts.workload import Session, Turn, Workload, WorkloadConfig, open_text, random_text, resolve_data_path

TRACE_BLOCK_TOKENS = 512                   # tokens per hash id in the Mooncake traces
DEFAULT_TRACE = "data/traces/conversation_trace.jsonl.gz"   # shipped in the repository (data/traces/README.md)
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass
class TraceConfig(WorkloadConfig):
    name: str = "trace"
    path: str = DEFAULT_TRACE         # absolute, or relative to the working directory or else to the repo; .gz is read
    use_timestamps: bool = True       # False: arrivals by request_rate / max_concurrency instead of the trace clock
    time_scale: float = 1.0           # replay speed: 10 plays the trace ten times faster
    block_tokens: int = TRACE_BLOCK_TOKENS   # characters per hash-id block (512 = the trace's real size)
    output_scale: float = 1.0         # output lengths are multiplied by this...
    max_output_len: int = 0           # ...and capped at this (0: no cap)


@dataclass
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def resolve_trace_path(path: str) -> Path:
    return resolve_data_path(path or DEFAULT_TRACE, (
        f"The repository ships {DEFAULT_TRACE} and data/traces/synthetic_trace.jsonl.gz; point workload.path at one "
        f"of them or at a Mooncake-format JSONL, plain or .gz (one object a line with {', '.join(FIELDS)})"))


def read_trace(path: Path, limit: int = 0) -> list[TraceRequest]:
    """The first `limit` requests (0: all), each line checked, errors naming file and line."""
    out = []
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            missing = [k for k in FIELDS if k not in row] if isinstance(row, dict) else list(FIELDS)
            if missing:
                raise ValueError(f"{where}: missing {', '.join(missing)} "
                                 f"(a Mooncake trace line has {', '.join(FIELDS)})")
            ids = row["hash_ids"]
            if not (isinstance(ids, list) and all(isinstance(h, int) for h in ids)):
                raise ValueError(f"{where}: hash_ids must be a list of integers, got {ids!r:.80}")
            n_in, n_out = row["input_length"], row["output_length"]
            if not (isinstance(n_in, int) and n_in >= 1 and isinstance(n_out, int) and n_out >= 0):
                raise ValueError(f"{where}: input_length must be an int >= 1 and output_length an int >= 0, "
                                 f"got {n_in!r}, {n_out!r}")
            if len(ids) * TRACE_BLOCK_TOKENS < n_in:
                raise ValueError(f"{where}: {len(ids)} hash_ids cover {len(ids) * TRACE_BLOCK_TOKENS} tokens, "
                                 f"fewer than input_length={n_in}")
            out.append(TraceRequest(float(row["timestamp"]), n_in, n_out, ids))
    return out


@WORKLOAD.register("trace")
class Trace(Workload):
    Config = TraceConfig

    def __init__(self, cfg: TraceConfig, seed: int):
        super().__init__(cfg, seed)
        problems = []
        if cfg.time_scale <= 0:
            problems.append(f"workload.time_scale={cfg.time_scale} must be > 0")
        if cfg.block_tokens < 1:
            problems.append(f"workload.block_tokens={cfg.block_tokens} must be >= 1")
        if cfg.output_scale <= 0 or cfg.max_output_len < 0:
            problems.append("workload.output_scale must be > 0 and workload.max_output_len >= 0")
        if problems:
            raise ValueError("; ".join(problems))
        self.timed = cfg.use_timestamps
        self._blocks: dict[int, str] = {}

    @classmethod
    def ignored_keys(cls, cfg: TraceConfig) -> dict[str, str]:
        if not cfg.use_timestamps:
            return {**super().ignored_keys(cfg), "time_scale": (
                "workload.use_timestamps=false arrives by workload.request_rate, not by the trace's clock that "
                "time_scale speeds up; drop workload.time_scale, or set workload.use_timestamps=true")}
        why = ("workload=trace replays the trace's own arrival times (workload.use_timestamps=true; "
               "workload.time_scale speeds them up); set workload.use_timestamps=false to arrive by request_rate")
        return {"request_rate": why, "burstiness": why}

    def block(self, hash_id: int) -> str:
        """The fixed text of one hash id: the same id always gives the same block (for this seed)."""
        text = self._blocks.get(hash_id)
        if text is None:
            n = self.cfg.block_tokens    # exactly n characters (random_text may end one short): blocks stay aligned
            text = self._blocks[hash_id] = random_text(random.Random(f"{self.seed}:{hash_id}"), n + 1)[:n]
        return text

    def prompt(self, req: TraceRequest) -> str:
        n = max(1, math.ceil(req.input_length * self.cfg.block_tokens / TRACE_BLOCK_TOKENS))
        return "".join(self.block(h) for h in req.hash_ids)[:n]

    def output_len(self, req: TraceRequest) -> int:
        n = max(1, round(req.output_length * self.cfg.output_scale))
        return min(n, self.cfg.max_output_len) if self.cfg.max_output_len else n

    def generate(self) -> list[Session]:
        c = self.cfg
        rows = read_trace(resolve_trace_path(c.path), c.num_requests)
        t0 = rows[0].timestamp_ms if rows else 0.0
        return [Session(f"trace-{i}", (r.timestamp_ms - t0) / 1e3 / c.time_scale,
                        [Turn(self.prompt(r), self.output_len(r))], carry_history=False)
                for i, r in enumerate(rows)]
