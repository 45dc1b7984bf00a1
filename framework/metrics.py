"""One results record per run: results.json on disk first, the same figures as a console table, W&B mirrors."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


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

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft_s * 1e3 for r in ok]
    e2e = [r.e2e_s * 1e3 for r in ok]
    tpot = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    d = max(duration_s, 1e-9)
    return {
        "requests_completed": len(ok),
        "requests_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput_req_s": len(ok) / d,
        "input_throughput_tok_s": prompt / d,
        "output_throughput_tok_s": sum(r.completion_tokens for r in ok) / d,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
        "e2e_p50_ms": _pct(e2e, 50), "e2e_p99_ms": _pct(e2e, 99),
    }


def failure_summary(records: list[RequestRecord]) -> str | None:
    """One sentence about the run's failed requests, or None when every request completed."""
    failed = [r for r in records if not r.ok]
    return f"{len(failed)} request(s) failed; first error: {failed[0].error}" if failed else None


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_table(results: dict[str, Any], title: str = "results") -> str:
    rows = [(k, f"{v:,.4g}" if isinstance(v, float) else str(v)) for k, v in results.items()
            if not isinstance(v, (dict, list))]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 24)
    return "\n".join([line, title, line] + [f"{k:<{width}}  {v:>20}" for k, v in rows] + [line])


def report(results: dict[str, Any], out_dir: str | os.PathLike, config: dict, logger_cfg, title: str) -> Path:
    """Write results.json (and the resolved config), print the table, mirror to W&B."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {**results, "git_sha": git_sha()}
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(format_table(results, title))
    print(f"results: {path}")
    if logger_cfg.mode != "disabled":
        _to_wandb(results, config, logger_cfg, out)
    return path


def _to_wandb(results: dict, config: dict, logger_cfg, out: Path) -> None:
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, mode=logger_cfg.mode, dir=str(out),
                     config=config, tags=list(logger_cfg.tags), reinit="finish_previous")
    flat = {k: v for k, v in results.items() if isinstance(v, (int, float, str, bool))}
    run.summary.update(flat)
    run.log({k: v for k, v in flat.items() if isinstance(v, (int, float))})
    nested = {k: v for k, v in results.items() if isinstance(v, dict)}
    for name, table in nested.items():     # e.g. expert load per layer, per-worker counts
        run.summary[name] = table
    run.finish()
