"""The summary metrics against their definitions (SGLang bench_serving / vLLM benchmark_serving), computed by brute
force over hand-made records; requests.jsonl round trip."""
from __future__ import annotations

import json
import math
import random

import pytest

from framework.core.records import RequestRecord, read_requests, write_requests
from framework.report.metrics import summarize
from framework.contracts.workload import SloConfig


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), written out."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def records(n: int = 40, seed: int = 0) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out_tokens = rng.choice([1, 2, 5, 17])
        ttft = rng.uniform(0.01, 0.5)
        itl = [rng.uniform(0.001, 0.05) for _ in range(out_tokens - 1)]
        out.append(RequestRecord(ok=True, prompt_tokens=rng.randint(10, 300), completion_tokens=out_tokens,
                                 cached_tokens=rng.randint(0, 9), ttft_s=ttft, e2e_s=ttft + sum(itl), itl_s=itl,
                                 send_s=i * 0.1, session=f"s{i}", worker=f"w{i % 3}"))
    out.append(RequestRecord(ok=False, error="HTTP 400: too long", send_s=9.0))
    return out


def test_a_multi_turn_runs_ttft_p50_by_turn_is_each_turns_own_and_absent_for_one_turn():
    recs = [RequestRecord(ok=True, prompt_tokens=10, completion_tokens=1, ttft_s=0.01 * (i + 1) + t, e2e_s=1.0,
                          session=f"s{i}", turn=t) for i in range(5) for t in (0, 2, 3)]
    got = summarize(recs + [RequestRecord(ok=False, error="x", turn=1)], 1.0)["ttft_p50_ms_by_turn"]
    assert list(got) == ["0", "2", "3"]       # turn 1 completed nothing: absent, the later turns keep their numbers
    assert list(got.values()) == pytest.approx([percentile([(0.01 * (i + 1) + t) * 1e3 for i in range(5)], 50)
                                                for t in (0, 2, 3)])
    assert "ttft_p50_ms_by_turn" not in summarize(records(), 7.5)       # one turn: nothing by turn


def test_the_time_outside_the_engines_is_the_ttft_less_the_engines_own_where_reported():
    rec = [RequestRecord(ok=True, prompt_tokens=4, completion_tokens=2, ttft_s=t, e2e_s=0.5, engine_ttft_s=e)
           for t, e in ((0.030, 0.020), (0.050, 0.020), (0.040, None))]
    out = summarize(rec, 1.0)
    assert out["outside_mean_ms"] == pytest.approx(20.0) and out["outside_sd_ms"] == pytest.approx(10.0)
    none = summarize(rec[2:], 1.0)                 # no engine reported its own (a peer's server)
    assert math.isnan(none["outside_mean_ms"]) and math.isnan(none["outside_sd_ms"])


def test_summary_matches_the_definitions():
    recs, duration = records(), 7.5
    ok = [r for r in recs if r.ok]
    s = summarize(recs, duration)
    assert (s["requests_completed"], s["requests_failed"]) == (len(ok), 1)
    prompt, output = sum(r.prompt_tokens for r in ok), sum(r.completion_tokens for r in ok)
    assert s["request_throughput_req_s"] == pytest.approx(len(ok) / duration)
    assert s["input_throughput_tok_s"] == pytest.approx(prompt / duration)
    assert s["output_throughput_tok_s"] == pytest.approx(output / duration)
    assert s["total_throughput_tok_s"] == pytest.approx((prompt + output) / duration)
    assert s["mean_concurrency"] == pytest.approx(sum(r.e2e_s for r in ok) / duration)
    assert s["cache_hit_rate"] == pytest.approx(sum(r.cached_tokens for r in ok) / prompt)
    series = {"ttft": [r.ttft_s for r in ok], "e2e": [r.e2e_s for r in ok],
              "tpot": [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1],
              "itl": [g for r in ok for g in r.itl_s]}              # every gap of every request, pooled
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        assert s[f"{name}_mean_ms"] == pytest.approx(sum(ms) / len(ms))
        for q in (50, 90, 99):
            assert s[f"{name}_p{q}_ms"] == pytest.approx(percentile(ms, q))


def test_goodput_counts_requests_within_every_slo():
    recs, duration = records(), 5.0
    slo = SloConfig(ttft_ms=200, tpot_ms=20)
    ok = [r for r in recs if r.ok]
    good = [r for r in ok if r.ttft_s * 1e3 <= 200 and (r.completion_tokens < 2 or r.tpot_s * 1e3 <= 20)]
    assert 0 < len(good) < len(ok)                                  # the SLOs bite, but not on everything
    s = summarize(recs, duration, slo)
    assert s["goodput_req_s"] == pytest.approx(len(good) / duration)
    assert s["slo_attainment"] == pytest.approx(len(good) / len(ok))
    assert summarize(recs, duration)["goodput_req_s"] == pytest.approx(len(ok) / duration)   # no SLO: all good
    e2e = SloConfig(e2e_ms=300)
    assert summarize(recs, duration, e2e)["goodput_req_s"] == pytest.approx(
        sum(r.e2e_s <= 0.3 for r in ok) / duration)


def test_empty_and_all_failed_runs_do_not_divide_by_zero():
    s = summarize([RequestRecord(ok=False, error="x")], 1.0)
    assert s["requests_completed"] == 0 and s["cache_hit_rate"] == 0.0 and math.isnan(s["ttft_p50_ms"])


def test_requests_jsonl_round_trip(tmp_path):
    recs = records(8)
    path = write_requests(recs, tmp_path / "requests.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(recs)
    back = read_requests(path)
    assert back == sorted(recs, key=lambda r: r.send_s)              # in the order they were sent


def engine_and_router_figures() -> dict:
    """What a cluster bench or mode=sim adds to the summary (keys as framework/engine/stats.py, the cluster's figures
    and the simulator write them): counters of CUDA graphs that never ran, per-layer MoE rows, a NaN estimate."""
    return {"workers": 2, "load_imbalance": 1.08, "router_retries": 0, "router_estimated_hit_rate": 0.66,
            "router_confirmed_hit_rate": float("nan"), "parallel": "tp", "parallel_size": 2, "dp_size": 1,
            "kv_sizing": "mem_budget", "kv_capacity_tokens_per_rank": 55533, "retractions": 0, "steps": 481,
            "graph_eligible_steps": 430, "graph_replayed_steps": 0, "graph_eager_steps": 481,
            "graph_eager_off_steps": 430, "graph_eligible_frac": 0.894,
            **{f"moe_layer{i}_{k}": 1.5 for i in (1, 2, 3) for k in ("routed_slots", "expert_imbalance",
                                                                      "ep_rank_imbalance")},
            "expert_imbalance_max": 2.07, "expert_load": {"layer1": [3, 1]}, "requests_per_rank": [6, 6],
            "sim_wall_s": 0.14}


def test_console_table_is_the_headline(tmp_path, capsys):
    """The printed table: the headline figures under a header naming the MoE backend with the parallelism and the
    router; no counters of graphs that never ran, no per-layer rows, no NaN, no goodput without an SLO; the rest in
    results.json, and the table says so."""
    from framework.report.metrics import report
    from framework.report.wandb_log import LoggerConfig, LogMode
    recs = records()
    results = {**summarize(recs, 7.5), **engine_and_router_figures()}
    config = {"moe": {"name": "ep", "dispatch": "all_to_all"}, "workload": {"slo": {"ttft_ms": None}}}
    title = "cluster bench: multi_turn, router=cache_aware, 2 instances, parallel=tpx2"
    report(results, tmp_path, config, LoggerConfig(mode=LogMode.disabled, plots=False), title, recs)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == title + ", moe=ep (dispatch=all_to_all)"
    assert len(lines) <= 24, out                                      # ~20 figures, rules, the results line
    for hidden in ("graph_", "moe_layer", "nan", "router_confirmed", "goodput", "slo_attainment", "retractions",
                   "steps", "kv_capacity"):
        assert hidden not in out, hidden
    for shown in ("ttft_p99_ms", "tpot_p50_ms", "output_throughput_tok_s", "router_estimated_hit_rate",
                  "expert_imbalance_max", "requests_failed"):
        assert shown in out, shown
    assert "more in results.json" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(results) <= set(saved)                                 # everything stays on disk

    results.update(graph_replayed_steps=400, retractions=3)           # what happened shows; so do SLOs that are set
    report(results, tmp_path, {**config, "workload": {"slo": {"ttft_ms": 200}}},
           LoggerConfig(mode=LogMode.disabled, plots=False), title, recs)
    out = capsys.readouterr().out
    assert "graph_replayed_steps" in out and "retractions" in out and "goodput_req_s" in out


@pytest.mark.long
def test_a_simulated_runs_table_as_printed(tmp_path):
    """`python run.py mode=sim` as typed: its table is the headline (about 20 lines), the header names the router,
    the parallelism and the MoE backend, and no counter of a CUDA graph that never ran, no per-layer row, no NaN."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "run.py", "mode=sim", "logger.mode=disabled", "logger.plots=false",
                        f"hydra.run.dir={tmp_path}"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("---"))
    last = next(i for i, line in enumerate(lines) if line.startswith("(+ ") and "more in results.json" in line)
    table = "\n".join(lines[first:last + 1])
    assert last - first <= 24, table
    header = lines[first + 1]
    assert "router=" in header and "parallel=" in header and "moe=" in header, header
    for hidden in ("graph_", "moe_layer", "nan", "router_confirmed"):
        assert hidden not in table, hidden
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "graph_eligible_steps" in saved and "router_confirmed_hit_rate" in saved    # kept on disk
