"""One record per request, as every load driver (HTTP, in-process, the simulator) writes it, and its file
(requests.jsonl: one JSON object a line, times in seconds)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

REQUESTS_FILE = "requests.jsonl"
RESULTS_FILE = "results.json"


@dataclass
class RequestRecord:
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    worker: str = ""
    error: str = ""
    send_s: float = 0.0                                  # when it was sent, seconds since the run began
    itl_s: list[float] = field(default_factory=list)    # gaps between consecutive streamed chunks after the first
    session: str = ""
    turn: int = 0
    route_reason: str = ""                               # servelab's router: why it chose the worker, and its
    estimated_cached: int | None = None                  # estimate of the cached prompt (the policy's unit)
    kv_transfer_bytes: int = 0                           # disaggregated serving: the KV moved from its prefill
    kv_transfer_s: float = 0.0                           # instance to its decode instance, and the writes' time
    engine_ttft_s: float | None = None                   # its arrival at the engine to its first token there (None:
                                                         # not reported); ttft_s less it: the time outside the engine

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


def write_requests(records: list[RequestRecord], path: str | os.PathLike) -> Path:
    """One JSON object a line, in the order the requests were sent (times in seconds)."""
    path = Path(path)
    with open(path, "w") as f:
        for r in sorted(records, key=lambda r: r.send_s):
            f.write(json.dumps({**asdict(r), "tpot_s": r.tpot_s}) + "\n")
    return path


def read_requests(path: str | os.PathLike) -> list[RequestRecord]:
    names = set(RequestRecord.__dataclass_fields__)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [RequestRecord(**{k: v for k, v in row.items() if k in names}) for row in rows]
