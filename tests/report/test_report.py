"""`python -m framework.report`: runs found under a directory, the settings that differ as columns, failed runs kept
with their error, the plots the runs support; one run's own plots."""
from __future__ import annotations

import csv
import json

from framework.report.aggregate import aggregate, main
from framework.report.plots import run_plots

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(d, router: str, rate: float, error: str = "", **extra) -> None:
    d.mkdir(parents=True)
    config = {"router": {"name": router, "port": 0}, "workload": {"name": "random", "request_rate": rate},
              "logger": {"mode": "offline"}, "seed": 0}
    results = {"requests_completed": 10, "requests_failed": 0, "output_throughput_tok_s": 100 * rate,
               "request_throughput_req_s": rate, "cache_hit_rate": 0.5 if router == "cache_aware" else 0.2,
               "ttft_p50_ms": 10 * rate, "ttft_p99_ms": 30 * rate, "tpot_p50_ms": 5.0, **extra}
    if error:
        results = {"error": error}
    (d / "config.json").write_text(json.dumps(config))
    (d / "results.json").write_text(json.dumps(results))


def test_rate_sweep_table_and_curve(tmp_path):
    sweep = tmp_path / "multirun"
    i = 0
    for router in ("round_robin", "cache_aware"):
        for rate in (1.0, 2.0, 4.0):
            fake_run(sweep / str(i), router, rate)
            i += 1
    fake_run(sweep / "6", "cache_aware", 8.0, error="cluster.instances=0: need at least 1")
    table, made = aggregate([sweep], tmp_path / "out")
    assert len(table) == 7
    assert [m.name for m in made] == ["rate_sweep.png"]
    assert all(p.read_bytes().startswith(PNG) for p in made)
    row = next(r for r in table if r["router.name"] == "cache_aware" and r["workload.request_rate"] == 2.0)
    assert row["output_throughput_tok_s"] == 200.0 and row["label"] == "router=cache_aware, workload.request_rate=2.0"
    assert "router.port" not in row and "logger.mode" not in row                 # differ without changing what ran
    failed = next(r for r in table if r["error"])
    assert "need at least 1" in failed["error"]
    with open(tmp_path / "out" / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 7
    assert "| router.name | workload.request_rate |" in (tmp_path / "out" / "summary.md").read_text()


def test_policy_comparison_and_cli(tmp_path, capsys):
    for i, router in enumerate(("round_robin", "random", "cache_aware")):
        fake_run(tmp_path / "runs" / str(i), router, 2.0)
    assert main([str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "3 runs" in out and "policies.png" in out
    assert (tmp_path / "runs" / "policies.png").read_bytes().startswith(PNG)
    assert main([str(tmp_path / "nowhere")]) == 2


def test_one_runs_plots(tmp_path):
    results = {"worker_load_timeline": {"t_s": [0.0, 0.5, 1.0], "in_flight": {"http://a:1": [0, 3, 1],
                                                                              "http://b:2": [0, 1, 0]}},
               "expert_load": {"layer1": [5, 1, 0, 2], "layer2": [1, 1, 1, 1]}}
    made = run_plots(results, tmp_path)
    assert [p.name for p in made] == ["worker_load.png", "expert_load.png"]
    assert all(p.read_bytes().startswith(PNG) for p in made)
    assert run_plots({"expert_load": {"layer1": [0, 0]}}, tmp_path / "x") == []     # nothing routed: no plot


def test_wandb_tables_of_mixed_values():
    """W&B refuses a table column mixing numbers and strings (a model's shapes beside its dtype): written as text."""
    import wandb

    from framework.report.wandb_log import tables
    out = tables({"model": {"vocab_size": 260, "dtype": "float32"}, "per_worker": {"w0": {"requests": 3}}})
    assert out["model"].get_column("value") == ["260", "float32"]
    assert out["per_worker"].get_column("requests") == [3] and isinstance(out["per_worker"], wandb.Table)


def test_two_swept_thresholds_make_a_heatmap(tmp_path):
    """A cache_threshold x balance_abs_threshold grid (one point failed): heatmap.png beside the table; a grid over a
    non-numeric setting gets none."""
    i = 0
    for threshold in (0.3, 0.5):
        for gap in (4, 32):
            fake_run(tmp_path / "grid" / str(i), "cache_aware", 2.0, error="boom" if i == 3 else "")
            config = json.loads((tmp_path / "grid" / str(i) / "config.json").read_text())
            config["router"].update(cache_threshold=threshold, balance_abs_threshold=gap)
            (tmp_path / "grid" / str(i) / "config.json").write_text(json.dumps(config))
            i += 1
    table, made = aggregate([tmp_path / "grid"], tmp_path / "out")
    assert len(table) == 4 and "heatmap.png" in [m.name for m in made]
    assert (tmp_path / "out" / "heatmap.png").read_bytes().startswith(PNG)
    for i, router in enumerate(("round_robin", "cache_aware")):
        fake_run(tmp_path / "mixed" / str(i), router, 1.0 + i)
    assert "heatmap.png" not in [m.name for m in aggregate([tmp_path / "mixed"], tmp_path / "out2")[1]]
