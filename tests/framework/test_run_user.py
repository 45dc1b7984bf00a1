"""`python run.py` as a researcher runs it off a terminal (a log file, a batch job): free ports by default, printed;
a progress line every progress_interval_s, start-up included; run.log holding the run's output; results.json strict
JSON and config.json naming the mode plainly; a port in use refused with the override that helps, its error in the
run's folder; mode=sim saying what it models."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from framework.core.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.long      # run.py end to end: a cluster, a refusal, a simulation


def run_py(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """run.py with stdout and stderr to pipes (not a terminal), as under nohup or a batch system."""
    return subprocess.run([sys.executable, "run.py", f"hydra.run.dir={out}", "logger.mode=disabled", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_a_default_bench_off_a_terminal(tmp_path):
    r = run_py(tmp_path, "workload.num_conversations=3", "workload.turns=2", "progress_interval_s=1")
    assert r.returncode == 0, r.stderr[-3000:]
    ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", r.stdout.split("\n", 1)[0])]
    assert r.stdout.startswith("cluster: router http://127.0.0.1:") and len(ports) == 3
    assert 30000 not in ports                                 # router.port=0 by default: free ports, printed
    assert "progress: starting 2 workers and the router, " in r.stderr, r.stderr[-3000:]
    log = (tmp_path / "run.log").read_text()
    assert "cluster bench: multi_turn, router=cache_aware" in log and "progress: starting 2 workers" in log
    results = strict_loads((tmp_path / "results.json").read_text())
    assert results["requests_completed"] == 6
    assert json.loads((tmp_path / "config.json").read_text())["mode"] == "bench"


def test_a_port_in_use_is_refused_with_the_override_that_helps(tmp_path):
    base = free_port_block("127.0.0.1", 3)
    with socket.socket() as held:                             # worker 0's port (router.port + 1) is taken
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        r = run_py(tmp_path, f"router.port={base}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"port {base + 1} on 127.0.0.1 for worker 0 is not available" in r.stderr
    assert "leave router.port and cluster.worker_ports unset (router.port=0, the default: free ports)" in r.stderr
    assert "Traceback" not in r.stderr
    results = strict_loads((tmp_path / "results.json").read_text())       # the run's folder says why it failed
    assert f"port {base + 1}" in results["error"] and "error: port" in (tmp_path / "run.log").read_text()


def test_mode_sim_says_what_it_models(tmp_path):
    r = run_py(tmp_path, "mode=sim", "workload.num_conversations=3", "workload.turns=2")
    assert r.returncode == 0, r.stderr[-3000:]
    cores = os.cpu_count()
    sentence = (f"simulated: the step times sim.cost=calibrated measured, one instance alone, each instance on CPU "
                f"cores of its own: not this host, where a real run's ranks, router and load client share {cores} "
                f"core{'s' if cores > 1 else ''} (sim.host_cores={cores} models that)")
    assert sentence in r.stdout
    results = strict_loads((tmp_path / "results.json").read_text())
    assert results["sim_models"] == sentence
    assert json.loads((tmp_path / "config.json").read_text())["mode"] == "sim"
