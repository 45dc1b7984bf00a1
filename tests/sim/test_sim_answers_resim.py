"""experiments/sim_fidelity/run.py --resimulate: a stored run's real runs simulated again with each --answers, each
with its own measured background, nothing run for real."""
from __future__ import annotations

import pytest

from framework.runs.sim import simulate
from script_loader import load_script

OVERRIDES = ["workload=multi_turn", "workload.num_conversations=3", "workload.turns=3", "workload.system_prompt_len=16",
             "workload.user_len=48", "workload.output_len=8", "cluster.instances=2", "logger.mode=disabled",
             "router=cache_aware"]


@pytest.mark.long               # ~1.1 s: six simulations
def test_resimulating_a_stored_run_reproduces_its_simulation_and_measured_answers_hit_less():
    f = load_script("experiments/sim_fidelity/run.py")
    printable = f.SIM + ["sim.cost.between=grid", "sim.answers=printable"]
    runs = []
    for background in (0.0, 0.5):        # each repeat's own background, as stored
        sim, _ = simulate(f.sim_config("router_ablation", OVERRIDES, printable, (background, None)))
        runs.append([{"case": "multi_turn/cache_aware", "host_background": background,
                      "real": {k: sim.get(k) for k in f.KEEP}}])        # the stored "real" runs: these simulations
    stored = {"cases": [{"case": "multi_turn/cache_aware", "study": "router_ablation", "overrides": OVERRIDES}],
              "runs": runs, "load_average": {"before": [0.5], "after": [0.5], "cores": 2}}
    (cell,), table = f.resimulate(stored, printable)
    assert cell["inside_real_range"] == {k: True for k in f.tables.JUDGED} and "multi_turn/cache_aware" in table
    assert [cell["sim_spread"][k] for k in f.tables.JUDGED] == [cell["real_spread"][k] for k in f.tables.JUDGED]
    (measured,), _ = f.resimulate(stored, f.SIM + ["sim.cost.between=grid", "sim.answers=measured"])
    assert measured["sim"]["cache_hit_rate"] < cell["sim"]["cache_hit_rate"] - 0.02
