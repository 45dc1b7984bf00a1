"""One results record per run: results.json on disk first (with requests.jsonl, one line per request, and the run's
plots beside it), the same figures as a console table, W&B mirrors them.

The summary metrics are those SGLang's bench_serving and vLLM's benchmark_serving report, under the same definitions:
mean, median (p50), p90 and p99 of TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL (every gap between two
streamed chunks, all requests pooled) and E2E latency; request, input, output and total token throughput over the run;
mean concurrency (the sum of E2E latencies over the run's duration); goodput, the completed requests per second that
met every SLO set (`workload.slo.*`; vLLM's definition).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from framework.core.paths import git_sha
from framework.core.records import REQUESTS_FILE, RESULTS_FILE, RequestRecord, write_requests
from framework.report.wandb_log import LogMode

def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if not len(ms):
        return {f"{name}_{k}_ms": float("nan") for k in ("mean", "p50", "p90", "p99")}
    return {f"{name}_mean_ms": float(ms.mean()),
            **{f"{name}_p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)}}


def meets_slo(r: RequestRecord, slo) -> bool:
    """Every SLO that is set (> 0) holds; a request with one output token has no TPOT to hold it to."""
    if slo is None:
        return True
    tpot = r.tpot_s
    return ((not slo.ttft_ms or r.ttft_s * 1e3 <= slo.ttft_ms) and (not slo.e2e_ms or r.e2e_s * 1e3 <= slo.e2e_ms)
            and (not slo.tpot_ms or tpot is None or tpot * 1e3 <= slo.tpot_ms))


def summarize(records: list[RequestRecord], duration_s: float, slo=None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok)
    d = max(duration_s, 1e-9)
    return {
        "requests_completed": len(ok),
        "requests_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput_req_s": len(ok) / d,
        "input_throughput_tok_s": prompt / d,
        "output_throughput_tok_s": output / d,
        "total_throughput_tok_s": (prompt + output) / d,
        "goodput_req_s": good / d,
        "slo_attainment": good / len(ok) if ok else 0.0,
        "mean_concurrency": sum(r.e2e_s for r in ok) / d,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        **_stats("ttft", [r.ttft_s for r in ok]),
        **_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
        **_stats("itl", [gap for r in ok for gap in r.itl_s]),
        **_stats("e2e", [r.e2e_s for r in ok]),
        **_ttft_by_turn(ok),
        **_outside(ok),
        "bench_serving": bench_serving_figures(ok, duration_s),
    }


def _ttft_by_turn(ok: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """A multi-turn workload's TTFT p50 per turn, keyed by the turn ("0" first; a turn no request completed is
    absent, not shifted; nothing for one turn): where in a conversation the time goes, as its later turns find more
    of their prompt cached."""
    turns = sorted({r.turn for r in ok})
    if len(turns) < 2:
        return {}
    return {"ttft_p50_ms_by_turn": {str(t): float(np.percentile([r.ttft_s for r in ok if r.turn == t], 50)) * 1e3
                                    for t in turns}}


def _outside(ok: list[RequestRecord]) -> dict[str, float]:
    """The requests' time outside the engines (client, router, HTTP: the client's TTFT less the engine's own, where
    the engine reported it): mean and standard deviation, ms (NaN: none reported; the deviation also with one). A
    retried request's TTFT counts from its first try, its engine's from the last: its failed tries count outside."""
    ms = np.asarray([r.ttft_s - r.engine_ttft_s for r in ok if r.engine_ttft_s is not None], dtype=float) * 1e3
    return {"outside_mean_ms": float(ms.mean()) if len(ms) else float("nan"),
            "outside_sd_ms": float(ms.std()) if len(ms) > 1 else float("nan")}


def bench_serving_figures(ok: list[RequestRecord], duration_s: float) -> dict[str, float]:
    """The figures SGLang v0.4's bench_serving prints and writes, under its names and definitions (calculate_metrics):
    `duration` from the first send (after its warm-up request) to the last request's end; `total_input_tokens` the
    completed requests' prompt tokens, `total_output_tokens` their output tokens; each throughput is its total over
    `duration`, `total_throughput` input plus output. One difference stays: the prompt tokens here are the server's
    count (its BOS included), where bench_serving counts its client's (random: the nominal input_len;
    generated-shared-prefix: tokenizer.encode(prompt), which adds the BOS itself)."""
    d = max(duration_s, 1e-9)
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.completion_tokens for r in ok)
    return {"duration": duration_s, "completed": len(ok), "total_input_tokens": total_input,
            "total_output_tokens": total_output, "request_throughput": len(ok) / d, "input_throughput": total_input / d,
            "output_throughput": total_output / d, "total_throughput": (total_input + total_output) / d,
            "concurrency": sum(r.e2e_s for r in ok) / d}


def failure_summary(records: list[RequestRecord]) -> str | None:
    """One sentence about the run's failed requests, or None when every request completed."""
    failed = [r for r in records if not r.ok]
    return f"{len(failed)} request(s) failed; first error: {failed[0].error}" if failed else None


# The console's headline, in this order; everything else stays in results.json. A figure shows when it has a value
# (not NaN: no router estimate outside the router), WHEN_NONZERO ones only when something happened.
HEADLINE = ("requests_completed", "requests_failed", "duration_s", "request_throughput_req_s",
            "output_throughput_tok_s", "goodput_req_s", "slo_attainment", "cache_hit_rate",
            "router_estimated_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
            "e2e_p50_ms", "e2e_p99_ms", "load_imbalance", "expert_imbalance_max", "verify_max_abs_err", "verify_atol",
            "verify_passed", "sim_wall_s")
WHEN_NONZERO = ("router_retries", "retractions", "graph_replayed_steps", "worker_restarts", "router_restarts",
                "workers_given_up")
SLO_KEYS = ("goodput_req_s", "slo_attainment")        # without an SLO, goodput is the request throughput


def _shown(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and not np.isfinite(v)) and not isinstance(v, (dict, list))


def headline(results: dict[str, Any], slo_set: bool = True) -> dict[str, Any]:
    """The figures the console shows: HEADLINE's with a value, a per-case logit error of mode=verify, the
    WHEN_NONZERO counters that moved."""
    out = {k: results[k] for k in HEADLINE if k in results and _shown(results[k]) and (slo_set or k not in SLO_KEYS)}
    out.update({k: v for k, v in results.items() if k.endswith("_max_abs_err") and _shown(v)})
    out.update({k: results[k] for k in WHEN_NONZERO if _shown(results.get(k)) and results[k]})
    return out


def describe(config: dict) -> str:
    """The MoE backend with its settings, as the header names it: `moe=ep (dispatch=all_to_all, kernel=auto)`."""
    moe = dict(config.get("moe") or {})
    name = moe.pop("name", "?")
    return f"moe={name}" + (f" ({', '.join(f'{k}={v}' for k, v in moe.items())})" if moe else "")


def _slo_set(config: dict) -> bool:
    slo = (config.get("workload") or {}).get("slo") or {}
    return any(slo.values()) if isinstance(slo, dict) else bool(slo)


def format_table(results: dict[str, Any], title: str = "results", config: dict | None = None) -> str:
    """The headline figures under the run's title (with its MoE backend when the title names an instance's
    parallelism but not its MoE), then how many more figures results.json holds."""
    if config and "parallel=" in title and "moe=" not in title:
        title = f"{title}, {describe(config)}"
    rows = [(k, f"{v:,.4g}" if isinstance(v, float) else str(v))
            for k, v in headline(results, True if config is None else _slo_set(config)).items()]
    rest = len(results) - len(rows)
    width = max([len(k) for k, _ in rows] + [20])
    line = "-" * max(width + 22, min(len(title), 100))
    return "\n".join([line, title, line] + [f"{k:<{width}}  {v:>20}" for k, v in rows] + [line]
                     + ([f"(+ {rest} more in results.json)"] if rest > 0 else []))


def report(results: dict[str, Any], out_dir: str | os.PathLike, config: dict, logger_cfg, title: str,
           records: list[RequestRecord] | None = None) -> Path:
    """Write results.json, the resolved config and (given records) requests.jsonl; draw the run's plots (PNG beside
    them); print the table; mirror everything to W&B."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {**results, "git_sha": git_sha()}
    path = out / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if records is not None:
        write_requests(records, out / REQUESTS_FILE)
    plots = []
    if logger_cfg.plots:
        from framework.report.plots import run_plots
        plots = run_plots(results, out)
    print(format_table(results, title, config))
    print(f"results: {path}" + (f"  plots: {', '.join(p.name for p in plots)}" if plots else ""))
    if LogMode(logger_cfg.mode) is not LogMode.disabled:
        from framework.report.wandb_log import log_run  # wandb imports slowly: only when it logs
        log_run(results, config, logger_cfg, out, plots)
    return path
