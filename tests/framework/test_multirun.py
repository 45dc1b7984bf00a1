"""Multiruns that survive a failed point (results.json says why, the exit status counts the failures), runs of one
multirun in one W&B group and named by their overrides, free ports for several clusters on one node."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import compose
from framework.multirun import sweep_outcome
from framework.cluster.ports import assign_free_ports
from framework.core.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]


def installed(module: str) -> bool:
    """find_spec raises, not returns None, when the parent package (hydra_plugins) is absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.long
def test_a_failed_point_is_recorded_and_the_multirun_goes_on(tmp_path):
    r = subprocess.run([sys.executable, "run.py", "-m", "cluster.http=false", "workload.num_requests=2",
                        "engine.kv_budget_mb=-1,1", "logger.mode=offline", f"hydra.sweep.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]                 # the exit status: how many points failed
    bad, good = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("0", "1"))
    assert bad["error"].startswith("engine.kv_budget_mb must be > 0") and "Traceback" not in r.stderr
    assert "error" not in good and good["requests_completed"] == 2
    assert "1 of 2 runs completed, 1 failed" in r.stderr
    assert len((tmp_path / "1" / "requests.jsonl").read_text().splitlines()) == 2
    (run_file,) = (tmp_path / "1" / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()                               # the W&B run's group and name, as W&B stored them
    assert str(tmp_path).encode() in data                                   # group: the multirun's directory
    assert b"engine.kv_budget_mb=1,workload.num_requests=2" in data          # name: the run's overrides


def test_sweep_outcome_counts_runs_without_results(tmp_path):
    for name, results in (("0", {"x": 1}), ("1", {"error": "boom"}), ("2", None)):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        if results is not None:
            (tmp_path / name / "results.json").write_text(json.dumps(results))
    total, failed = sweep_outcome(tmp_path)
    assert total == 3 and len(failed) == 2 and "boom" in failed[0] and "no results.json" in failed[1]


def test_port_zero_takes_free_distinct_ports():
    cfg = compose(["router.port=0", "cluster.instances=3"])
    assign_free_ports(cfg)
    ports = [cfg.router.port, *cfg.cluster.worker_ports]
    assert len(set(ports)) == 4 and 0 not in ports
    fixed = compose(["router.port=31000", "cluster.instances=3"])
    assign_free_ports(fixed)
    assert fixed.router.port == 31000 and fixed.cluster.worker_ports == []    # asked ports are kept
    assert len(set(free_ports("127.0.0.1", 50))) == 50


@pytest.mark.slow
@pytest.mark.skipif(not installed("hydra_plugins.hydra_joblib_launcher"),
                    reason="hydra-joblib-launcher is not installed ('.[studies]')")
def test_two_clusters_at_once_on_one_node(tmp_path):
    """hydra/launcher=node runs both points at the same time; router.port=0 keeps their ports apart."""
    r = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=node", "router.port=0",
                        "router=round_robin,random", "cluster.instances=1", "workload.num_requests=2",
                        "workload.num_conversations=1", "logger.mode=disabled", f"hydra.sweep.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("0", "1")]
    assert all(x["requests_completed"] == 2 for x in runs)
    ports = [int(next(iter(x["per_worker"])).rsplit(":", 1)[1]) for x in runs]
    assert ports[0] != ports[1]


PLUGINS = {"node": "hydra_joblib_launcher", "slurm": "hydra_submitit_launcher", "ray": "hydra_ray_launcher",
           "tune_cache_aware": "hydra_optuna_sweeper"}


@pytest.mark.parametrize("group, option", [("launcher", "node"), ("launcher", "slurm"), ("launcher", "ray"),
                                           ("sweeper", "tune_cache_aware")])
def test_launcher_and_sweeper_configs_compose(group, option):
    if not installed(f"hydra_plugins.{PLUGINS[option]}"):
        pytest.skip(f"{PLUGINS[option]} is not installed")
    from hydra import compose as hydra_compose, initialize_config_dir
    from framework.config import CONF_DIR, register_configs
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"hydra/{group}={option}"], return_hydra_config=True)
    assert PLUGINS[option] in cfg.hydra[group]["_target_"]


def test_every_launcher_and_sweeper_config_is_covered():
    shipped = {p.stem for p in (ROOT / "conf" / "hydra").rglob("*.yaml")}
    assert shipped == set(PLUGINS)
