"""One plugin of each kind from a package outside the repository (tests/extension/servelab_oot), found only through
the `servelab.plugins` entry-point group and `hydra.searchpath`, run with run.py as a user runs it:

- routing (router=last_worker) and the workload (workload=fixed_prompts) on a real local cluster of 2 workers, the
  MoE backend (moe=strided_ep) inside them;
- the cost model (sim.cost=constant_step) in mode=sim, with the same routing and workload;
- the parallelism (parallel=tp_replicated_vocab) and the MoE backend on 2 ranks in mode=verify: logits against the
  single-process reference.

The package is installed the way pip leaves it, without pip: a `.dist-info` with its entry points in a directory on
PYTHONPATH, so run.py, the router, every worker and every rank (all child processes) find it. The three runs start
together (they wait on sockets and startup as much as they compute) and each test checks its own.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(__file__).resolve().parent          # holds servelab_oot/
SEARCHPATH = "hydra.searchpath=[pkg://servelab_oot.conf]"
PROMPTS = ["one prompt", "a longer second prompt", "the third and longest prompt of the set", "fourth"]
STEP_S = 0.037                                          # constant_step's step time: no built-in model gives it
RUNS = {
    "cluster": ["router=last_worker", "workload=fixed_prompts", "moe=strided_ep", "cluster.instances=2",
                "router.port=0", "workload.prompts=[" + ",".join(f'"{p}"' for p in PROMPTS) + "]",
                f"workload.num_requests={len(PROMPTS) - 1}", "workload.output_len=6"],
    "sim": ["mode=sim", "sim.cost=constant_step", f"sim.cost.step_s={STEP_S}", "router=last_worker",
            "workload=fixed_prompts", "cluster.instances=2", "sim.network_latency_s=0", "sim.router_overhead_s=0"],
    "verify": ["mode=verify", "parallel=tp_replicated_vocab", "moe=strided_ep", "moe.offset=1"],
}
TIMEOUT_S = 300
pytestmark = pytest.mark.long   # three run.py processes (a cluster, a simulation, 2-rank verify)


def install_dist_info(site: Path) -> None:
    """What `pip install` of the package would leave for importlib.metadata: its name and its entry points."""
    info = site / "servelab_oot-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: servelab-oot\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[servelab.plugins]\nservelab_oot = servelab_oot:register\n")


class Runs:
    """The run.py processes, started at once; `result(name)` waits for one and reads its run directory."""

    def __init__(self, base: Path):
        install_dist_info(base / "site")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(base / "site"), str(PACKAGE_DIR), os.environ.get("PYTHONPATH")]))}
        self.dirs = {name: base / name for name in RUNS}
        self.procs = {}
        for name, overrides in RUNS.items():
            log = open(base / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "run.py", f"hydra.run.dir={self.dirs[name]}", SEARCHPATH, "logger.mode=disabled",
                 *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
        self.logs = {name: base / f"{name}.log" for name in RUNS}

    def result(self, name: str) -> tuple[dict, list[dict]]:
        rc = self.procs[name].wait(TIMEOUT_S)
        assert rc == 0, f"run.py {' '.join(RUNS[name])} exited {rc}:\n{self.logs[name].read_text()[-3000:]}"
        out = self.dirs[name]
        requests = out / "requests.jsonl"
        records = [json.loads(line) for line in requests.read_text().splitlines()] if requests.exists() else []
        return json.loads((out / "results.json").read_text()), records

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()            # run.py stops its workers, router and ranks on SIGTERM
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = Runs(tmp_path_factory.mktemp("out_of_tree"))
    yield started
    started.stop()


def test_routing_and_workload_on_a_real_cluster(runs):
    results, records = runs.result("cluster")
    *others, last = results["per_worker"]                    # in the order the router added the workers
    assert len(others) == 1
    assert results["router_reasons"] == {"last": len(PROMPTS) - 1}          # the policy's own reason, every time
    assert {r["worker"] for r in records} == {last} and results["per_worker"][others[0]]["requests"] == 0
    assert all(r["ok"] and r["route_reason"] == "last" and r["completion_tokens"] == 6 for r in records)
    by_session = {r["session"]: r["prompt_tokens"] for r in records}
    # the workload's own prompts, in order, capped by workload.num_requests (the byte tokenizer: a token a character)
    assert by_session == {f"fixed-{i}": len(p) for i, p in enumerate(PROMPTS[:-1])}


def test_cost_model_sets_simulated_latency(runs):
    results, records = runs.result("sim")
    assert results["sim_cost_model"] == "constant_step" and results["sim_cost_config"]["step_s"] == STEP_S
    assert records and {r["worker"] for r in records} == {"sim://instance-1"}
    assert {r["route_reason"] for r in records} == {"last"}

    def steps(seconds: float) -> float:
        return seconds / STEP_S
    for r in records:             # everything arrives at 0 with no network: every latency is whole steps
        assert r["ok"] and r["send_s"] == 0.0
        for t in (r["ttft_s"], r["e2e_s"], *r["itl_s"]):
            assert steps(t) >= 1 - 1e-9 and math.isclose(steps(t), round(steps(t)), abs_tol=1e-6), t
    # the instance computed without a gap from the first arrival to the last token: the slowest request took every
    # step the scheduler ran
    assert math.isclose(max(r["e2e_s"] for r in records), results["steps"] * STEP_S, rel_tol=1e-9)


def test_parallelism_and_moe_pass_verify_on_two_ranks(runs):
    results, _ = runs.result("verify")
    assert results["verify_passed"] and results["verify_max_abs_err"] <= results["verify_atol"]
    assert results["parallel"] == "tp_replicated_vocab" and results["vocab"] == "replicated"   # its describe()
    assert results["parallel_size"] == 2
    # every case served every request on both ranks (one DP group); the plugin's own step-log check passed with it
    for case in ("radix_cache", "chunked_prefill", "tight_kv_retract", "no_radix_cache"):
        assert results[f"{case}_requests_per_rank"][0] == results[f"{case}_requests_per_rank"][1] > 0
