"""Run folders as run.py leaves them, written with the project's own writers: results.json, config.json and
requests.jsonl by framework.report.metrics.report, .hydra/overrides.yaml as Hydra writes it (a YAML list of the
overrides as typed)."""
from __future__ import annotations

import random
from pathlib import Path

import yaml

from framework.core.records import RequestRecord
from framework.report.metrics import report, summarize
from framework.report.wandb_log import LoggerConfig, LogMode

ROUTER_FIELDS = {"cache_aware": {"cache_threshold": 0.5, "balance_abs_threshold": 32, "tie_break": "node_hash"},
                 "round_robin": {}, "random": {}, "sticky_prefix": {"tokenizer": None, "spill_factor": 2.0}}


def records(rate: float, hit: float, seed: int, n: int = 24) -> list[RequestRecord]:
    """Requests whose TTFT grows with the offered rate and shrinks with the hit rate: distinct figures per run."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ttft = (0.02 + 0.01 * rate) * (1.5 - hit) * rng.uniform(0.5, 2.0)
        itl = [rng.uniform(0.004, 0.012) * (1 + rate / 8) for _ in range(7)]
        out.append(RequestRecord(ok=True, prompt_tokens=200, completion_tokens=8, cached_tokens=int(200 * hit),
                                 ttft_s=ttft, e2e_s=ttft + sum(itl), itl_s=itl, send_s=i / rate,
                                 worker=f"http://127.0.0.1:{4000 + i % 2}"))
    return out


def config(router: str = "cache_aware", rate: float = 4.0, **workload) -> dict:
    return {"mode": "bench", "seed": 0, "router": {"name": router, "port": 30000 + random.randrange(100),
                                                   **ROUTER_FIELDS.get(router, {"policy_knob": 1})},
            "workload": {"name": "multi_turn", "request_rate": rate, "slo": {"ttft_ms": None}, **workload},
            "parallel": {"name": "single", "size": 1}, "moe": {"name": "reference"},
            "logger": {"mode": "disabled", "name": None}}


def write_run(d: Path, overrides: list[str] | None, router: str = "cache_aware", rate: float = 4.0,
              hit: float = 0.5, error: str = "", seed: int = 0, **workload) -> Path:
    """One run folder; `overrides` None: no .hydra/ (a run an experiment script wrote)."""
    d = Path(d)
    recs = records(rate, hit, seed)
    results = {**summarize(recs, len(recs) / rate), "router_estimated_hit_rate": float("nan"),
               "router_confirmed_hit_rate": float("nan")}
    if error:
        results = {"error": error}
    logger = LoggerConfig(mode=LogMode.disabled, plots=False)
    report(results, d, config(router, rate, **workload), logger, f"bench: {router}", None if error else recs)
    if overrides is not None:
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return d
