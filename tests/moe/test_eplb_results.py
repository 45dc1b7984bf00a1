"""EPLB's cost in a run's figures (issue 21): the experts moved and their bytes reach an instance's stats and
results.json through the MoE contract (`MoEBackend.stats`, summed over the MoE layers), counted over the run only."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import compose
from framework.core.registry import PARALLELISM
from framework.dist.group import Group
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.engine.stats import engine_figures, instance_stats
from framework.model.moe_stats import PLACEMENT_KEYS

ROOT = Path(__file__).resolve().parents[2]


def _serve(engine: Engine, prompts: list[str]) -> None:
    for p in prompts:
        engine.add(Req(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    while engine.scheduler.has_work():
        engine.step()


def test_rebalances_reach_the_instance_stats_and_the_run_counts_only_its_own():
    cfg = compose(["logger.mode=disabled", "moe=ep", "moe.num_redundant_experts=2", "moe.eplb.rebalance_every=1"])
    engine = Engine(cfg.model, cfg.engine, PARALLELISM.build("single", cfg.parallel, Group()), cfg.moe, cfg.seed)
    backends = [b.ffn.backend for b in engine.model.layers if getattr(b.ffn, "backend", None) is not None]
    _serve(engine, ["warm the instance up"])
    before = instance_stats([engine.server_info()])
    at_start = sum(b.stats["eplb_rebalances"] for b in backends)
    _serve(engine, ["the run", "its second request"])
    after = instance_stats([engine.server_info()])
    assert after["eplb_rebalances"] == sum(b.stats["eplb_rebalances"] for b in backends) > at_start > 0
    figures = engine_figures([before], [after])
    assert figures["eplb_rebalances"] == after["eplb_rebalances"] - at_start
    assert figures["eplb_experts_moved"] == figures["eplb_bytes_moved"] == 0     # one rank holds every expert


def test_a_backend_that_places_nothing_adds_no_eplb_figures():
    cfg = compose(["logger.mode=disabled"])
    engine = Engine(cfg.model, cfg.engine, PARALLELISM.build("single", cfg.parallel, Group()), cfg.moe, cfg.seed)
    _serve(engine, ["x"])
    assert not set(PLACEMENT_KEYS) & set(engine_figures([{}], [instance_stats([engine.server_info()])]))


@pytest.mark.long
def test_run_py_reports_the_bytes_of_the_experts_eplb_moved_between_two_ranks(tmp_path):
    """The command of experiments/README.md's wide-EP section, smaller: every moved expert carries its gate, up and
    down projections (3 x hidden x moe_intermediate values)."""
    overrides = ["cluster.http=false", "parallel=tp", "parallel.size=2", "moe=ep", "moe.num_redundant_experts=4",
                 "moe.eplb.rebalance_every=2", "workload.num_conversations=4", "workload.turns=2",
                 "logger.mode=disabled"]
    done = subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    m = compose(overrides).model
    per_expert = 3 * m.hidden_size * m.moe_intermediate_size * m.linear_itemsize
    assert r["eplb_rebalances"] > 0 and r["eplb_experts_moved"] > 0
    assert r["eplb_bytes_moved"] == r["eplb_experts_moved"] * per_expert
