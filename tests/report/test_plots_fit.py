"""Every plot the project draws, rendered on small synthetic or committed results, reads on a screen: no text outside
the figure, no tick labels over one another, no legend over data, the frame's labels clear of each other, the PNG
within MAX_PNG_PX (tests/report/plot_fit.py checks each figure as the `drawn` fixture sees it saved).

framework/report's plots here (the comparison plots are also rendered by test_report.py's runs); the experiments'
plot functions, fed their committed results.json, under `long` (each script's imports cost seconds)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from framework.report import plots
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"


def test_one_runs_plots_fit_at_scale(tmp_path, drawn):
    """Many workers (their spread, not 32 lines) and many experts (DeepSeek-V2's 160 over 59 MoE layers: thinned
    ticks); test_report.py draws the few-of-each versions."""
    t = [0.5 * i for i in range(40)]
    rng = np.random.default_rng(0)
    many = {f"http://10.0.0.{i}:30000": rng.integers(0, 30, len(t)).tolist() for i in range(32)}
    plots.worker_load({"t_s": t, "in_flight": many}, tmp_path / "workers_many.png")
    plots.expert_heatmap({f"layer{i}": rng.integers(0, 500, 160).tolist() for i in range(1, 60)},
                         tmp_path / "experts_v2.png")
    assert len(drawn) == 2 and not drawn.problems, drawn.problems


@pytest.mark.long
def test_study_plots_fit_at_their_extremes(tmp_path, drawn):
    """A rate sweep of one series over a doubling range, long labels on many runs, a threshold grid too wide for
    three panels a row (they stack); test_report.py draws the ordinary cases."""
    sweep = [{"rate": r, "output_throughput_tok_s": 30.0 * r, "ttft_p50_ms": 20.0 * r, "ttft_p99_ms": 90.0 * r,
              "tpot_p50_ms": 8.0 + r, "tpot_p99_ms": 12.0 + r} for r in (0.5, 1, 2, 4, 8, 16, 32, 64)]
    plots.rate_sweep({"": sweep}, tmp_path / "rate_sweep.png")
    runs = [{"label": f"router=cache_aware_v2 router.cache_threshold=0.{i} workload=agent workload.num_sessions=64",
             "ttft_p50_ms": 10.0 + i, "ttft_p90_ms": 100.0 * i, "ttft_p99_ms": 12000.0 + i} for i in range(12)]
    plots.metric_bars(runs, "Time to first token", "TTFT (ms)", [("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"),
                                                                 ("ttft_p99_ms", "p99")], tmp_path / "ttft.png")
    grid = [{"router.cache_threshold": x, "router.balance_abs_threshold": y, "cache_hit_rate": 0.1 * x + 0.01 * y,
             "ttft_p99_ms": 1000.0 * x + y, "output_throughput_tok_s": 5000.0 + 10 * y}
            for x in (0.1, 0.3, 0.5, 0.7, 0.9) for y in (4, 32)]
    heat = plots.heatmap(grid, "router.cache_threshold", "router.balance_abs_threshold", tmp_path / "heatmap.png")
    assert drawn[heat.name].get_size_inches()[1] > drawn[heat.name].get_size_inches()[0]      # stacked
    assert len(drawn) == 3 and not drawn.problems, drawn.problems


def committed(relative: str) -> dict:
    return json.loads((EXPERIMENTS / relative).read_text())


@pytest.mark.long
def test_experiment_plots_fit(tmp_path, drawn, monkeypatch):
    """Each experiment's plot function on its committed results: routing_study (and sim_repro's Mooncake figures,
    drawn by the same function), sim_repro's router blog, sim_fidelity, dp_attn_vs_tp at scale; two_level on a
    synthetic grid of its current layouts and routers."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    study = load_script(EXPERIMENTS / "routing_study" / "plot.py", own_folder=True)
    study.redraw(EXPERIMENTS / "routing_study" / "results.json", tmp_path / "routing_study")
    repro = load_script(EXPERIMENTS / "sim_repro" / "run.py", own_folder=True)
    results = committed("sim_repro/results.json")
    repro.plot_blog(results["router_blog"], tmp_path / "router_blog.png")
    moon = results["mooncake"]
    n = max(r["instances"] for r in moon["rows"])
    study.plot_workload([{**r, "contender": r["router"]} for r in moon["rows"] if r["instances"] == n],
                        f"mooncake_x{n}", moon["ceiling_hit_rate"], tmp_path,
                        title=f"the Mooncake conversation trace, {n} x DeepSeek-V2 (8 x H100, TP 8)")
    two = load_script(EXPERIMENTS / "two_level" / "run.py", own_folder=True)
    grid = [{"layout": lay, "router": router, "cache_hit_rate": 0.3 + 0.05 * i, "ttft_p99_ms": 2000.0 - 100 * j,
             "output_throughput_tok_s": 19000.0 + 500 * i} for i, lay in enumerate(two.LAYOUTS)
            for j, router in enumerate(two.ROUTERS)]       # every cell its layouts and routers make, as it grows
    two.plot(grid, 0.6, tmp_path / "two_level.png")
    load_script(EXPERIMENTS / "sim_fidelity" / "tables.py", own_folder=True).plot(
        committed("sim_fidelity/results.json")["cases"], tmp_path / "sim_vs_real.png")
    at_scale = load_script(EXPERIMENTS / "dp_attn_vs_tp" / "at_scale.py", own_folder=True)
    monkeypatch.setattr(at_scale, "HERE", tmp_path)          # it writes beside itself: not over the committed PNG
    at_scale.plot(committed("dp_attn_vs_tp/results_at_scale.json")["rows"])
    assert len(drawn) == 10, sorted(drawn)
    assert not drawn.problems, "\n".join(drawn.problems)
