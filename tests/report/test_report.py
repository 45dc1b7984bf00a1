"""`python -m framework.report RUN_DIR...` from the user's side, on run folders written with the project's own
writers (tests/report/report_runs.py): exit status, what it prints, the files it writes, and how it names the runs
(their overrides, not every field a group choice changed)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from framework.report.aggregate import main
from framework.report.plots import run_plots
from framework.report.wandb_log import LoggerConfig, LogMode, run_name
from report_runs import write_run

PNG = b"\x89PNG\r\n\x1a\n"
PER_METRIC = ["throughput.png", "ttft.png", "tpot.png", "itl.png", "e2e.png", "cache_hit_rate.png"]


def strict(text: str):
    """JSON as a strict parser reads it: NaN or Infinity is an error."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


def bar_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def router_rate_sweep(sweep: Path) -> Path:
    """router x request rate as a Hydra multirun leaves it (one folder per point), the last point failed."""
    i = 0
    for router, hit in (("round_robin", 0.2), ("sticky_prefix", 0.7)):
        for rate in (1.0, 2.0, 4.0):
            write_run(sweep / str(i), ["mode=bench", f"router={router}", f"workload.request_rate={rate}",
                                       "router.port=0"], router, rate, hit, seed=i)
            i += 1
    write_run(sweep / str(i), ["mode=bench", "router=sticky_prefix", "workload.request_rate=8.0", "router.port=0"],
              "sticky_prefix", 8.0, error="cluster.instances=0: need at least 1")
    return sweep


def test_a_multirun_reads_by_its_overrides(tmp_path, drawn, capsys):
    """router x request rate, one point failed: the table opens with the two swept overrides (not the router's
    fields), the failed point kept with its error; one plot per metric and the rate sweep, each labelled by the
    overrides, every label fitting, no layout warning."""
    sweep = router_rate_sweep(tmp_path / "multirun" / "2026-12-01" / "10-00-00")
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # "Tight layout not applied" and the like
        assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    head = (sweep / "summary.md").read_text().splitlines()[0]
    assert head.startswith("| router | workload.request_rate | requests_completed |"), head
    assert "tokenizer" not in head and "router.name" not in head and "router_confirmed" not in head
    assert head in out and "7 runs" in out
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["router"] for row in table] == ["round_robin"] * 3 + ["sticky_prefix"] * 4     # Hydra's order
    assert "need at least 1" in table[-1]["error"] and table[-1]["workload.request_rate"] == "8.0"
    summary = strict((sweep / "summary.json").read_text())
    assert summary[0]["label"] == "router=round_robin workload.request_rate=1.0"
    assert sorted(drawn) == sorted(PER_METRIC + ["rate_sweep.png"])
    assert bar_labels(drawn["ttft.png"])[-1] == "router=sticky_prefix workload.request_rate=4.0"
    legend = [t.get_text() for t in drawn["rate_sweep.png"].legends[0].get_texts()]
    assert legend == ["router=round_robin", "router=sticky_prefix", "p50", "p99"]
    assert not drawn.problems, drawn.problems
    assert not (sweep / "heatmap.png").exists()                  # a router name is no grid axis


def test_two_single_runs_compare(tmp_path, monkeypatch):
    """DIR1 DIR2: `router=round_robin` against a run at the defaults, which reads as the router it ran with; the
    default output folder is ./report."""
    one = write_run(tmp_path / "outputs" / "a" / "10-00-00", ["router=round_robin"], "round_robin", hit=0.2)
    two = write_run(tmp_path / "outputs" / "a" / "10-05-00", [], "cache_aware", hit=0.6, seed=1)
    monkeypatch.chdir(tmp_path)
    assert main([str(one), str(two), "--no-plots"]) == 0
    assert (tmp_path / "report" / "summary.md").read_text().startswith("| router | requests_completed |")
    labels = [r["label"] for r in strict((tmp_path / "report" / "summary.json").read_text())]
    assert labels == ["router=round_robin", "router=cache_aware"]


def test_repeats_and_runs_without_overrides(tmp_path, drawn):
    """Two repeats of one setting read as their folders; runs an experiment script wrote (no .hydra/) read by the
    resolved config's differences, a group's choice standing for the fields it brings."""
    write_run(tmp_path / "rep" / "0", ["router=random"], "random", seed=0)
    write_run(tmp_path / "rep" / "1", ["router=random"], "random", seed=1)
    assert main([str(tmp_path / "rep"), "--no-plots"]) == 0 and not drawn
    assert (tmp_path / "rep" / "summary.md").read_text().startswith("| run | router | requests_completed |")
    labels = [r["label"] for r in strict((tmp_path / "rep" / "summary.json").read_text())]
    assert labels == ["router=random (0)", "router=random (1)"]
    write_run(tmp_path / "script" / "x", None, "cache_aware", num_requests=10)
    write_run(tmp_path / "script" / "y", None, "sticky_prefix", num_requests=20)
    assert main([str(tmp_path / "script"), "--no-plots"]) == 0
    head = (tmp_path / "script" / "summary.md").read_text().splitlines()[0]
    assert head.startswith("| router | workload.num_requests | requests_completed |"), head
    labels = [r["label"] for r in strict((tmp_path / "script" / "summary.json").read_text())]
    assert labels == ["router=cache_aware workload.num_requests=10", "router=sticky_prefix workload.num_requests=20"]


@pytest.mark.long
def test_two_swept_thresholds_make_a_heatmap(tmp_path, drawn):
    """A cache_threshold x balance_abs_threshold grid, one point failed: heatmap.png beside the table, its three
    panels side by side, every plot's labels fitting."""
    i = 0
    for threshold in (0.1, 0.5, 0.9):
        for gap in (4, 32):
            write_run(tmp_path / "grid" / str(i), ["router=cache_aware", f"router.cache_threshold={threshold}",
                                                   f"router.balance_abs_threshold={gap}"], hit=threshold,
                      error="boom" if i == 3 else "", seed=i)
            i += 1
    assert main([str(tmp_path / "grid"), "--out", str(tmp_path / "out")]) == 0
    head = (tmp_path / "out" / "summary.md").read_text().splitlines()[0]
    assert head.startswith("| router.cache_threshold | router.balance_abs_threshold | requests_completed |")
    heat = drawn["heatmap.png"]
    assert [ax.get_title() for ax in heat.axes if ax.get_title()] == ["cache hit rate", "TTFT p99 (ms)",
                                                                       "output tok/s"]
    assert not drawn.problems, drawn.problems


def test_nothing_to_read_is_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such run directory" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2


def test_one_runs_plots(tmp_path, drawn):
    results = {"worker_load_timeline": {"t_s": [0.0, 0.5, 1.0], "in_flight": {"http://a:1": [0, 3, 1],
                                                                              "http://b:2": [0, 1, 0]}},
               "expert_load": {"layer1": [5, 1, 0, 2], "layer2": [1, 1, 1, 1]}}
    made = run_plots(results, tmp_path)
    assert [p.name for p in made] == ["worker_load.png", "expert_load.png"]
    assert all(p.read_bytes().startswith(PNG) for p in made) and not drawn.problems, drawn.problems
    assert run_plots({"expert_load": {"layer1": [0, 0]}}, tmp_path / "x") == []     # nothing routed: no plot


def test_wandb_run_named_by_its_overrides(tmp_path):
    """A run's W&B name: logger.name, else its overrides as typed (ports and logger settings left out), else
    "defaults", never a random name."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
        ["router=round_robin", "workload.request_rate=2.0", "router.port=0", "logger.mode=offline"]))
    logger = LoggerConfig(mode=LogMode.offline)
    assert run_name(logger, run) == "router=round_robin workload.request_rate=2.0"
    assert run_name(LoggerConfig(name="mine"), run) == "mine"
    assert run_name(logger, tmp_path) == "defaults"


def test_wandb_tables_of_mixed_values():
    """W&B refuses a table column mixing numbers and strings (a model's shapes beside its dtype): written as text."""
    import wandb

    from framework.report.wandb_log import tables
    out = tables({"model": {"vocab_size": 260, "dtype": "float32"}, "per_worker": {"w0": {"requests": 3}}})
    assert out["model"].get_column("value") == ["260", "float32"]
    assert out["per_worker"].get_column("requests") == [3] and isinstance(out["per_worker"], wandb.Table)


@pytest.mark.long
def test_the_command_with_a_wandb_mirror(tmp_path):
    """`python -m framework.report DIR --wandb offline`, as typed: exit 0, no warning on stderr, the table on
    stdout, and one W&B run (job_type=report) named by the compared runs' overrides."""
    sweep = router_rate_sweep(tmp_path / "multirun")
    r = subprocess.run([sys.executable, "-m", "framework.report", str(sweep), "--wandb", "offline"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "always"})
    assert r.returncode == 0, r.stderr
    assert "layout" not in r.stderr and "matplotlib" not in r.stderr, r.stderr     # W&B's own warnings aside
    assert "| router | workload.request_rate |" in r.stdout and "rate_sweep.png" in r.stdout
    logs = list((sweep / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    assert b"report: router=round_robin workload.request_rate=1.0 | router=round_robin" in logs[0].read_bytes()
