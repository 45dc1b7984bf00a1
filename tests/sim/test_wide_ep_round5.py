"""Issue 21, round 5: the per-batch fluctuation of expert loads around the replayed distribution
(`sim.cost.expert_load_fluctuation`, plugins/cost/lib/load_fluctuation.py), default off, sized by
experiments/wide_ep/fit_load_fluctuation.py from the lmsys blog's measured per-step balancedness."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from framework.config import compose
from framework.contracts.cost import Step, decode_shape
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.runs.sim import cost_instance, cost_model
from plugins.cost.lib.load_fluctuation import LoadFluctuation

WIDE_EP = REPO_ROOT / "experiments" / "wide_ep"
ROUND4 = ["sim.cost.expert_loads=experiments/wide_ep/loads/sglang_blog_decode.json", "sim.cost.deepgemm_rates=true",
          "sim.cost.fa3_prefill_rates=true", "sim.cost.fa3_decode_splits=true"]


def test_off_it_prices_round_4s_decode_cell_and_on_the_busiest_rank_carries_what_the_blog_measured():
    fit = json.loads((WIDE_EP / "loads" / "sglang_blog_decode_balancedness.json").read_text())
    cell = json.loads((WIDE_EP / "predictions_round4.json").read_text())["cells"]["decode_2k_ep72_tok_s_per_node"]
    run = fit["run"]
    step = Step((decode_shape(run["tokens_per_device"], run["tokens_per_device"] * 2000),) * run["ep"], graph=True)
    cfg = compose(["experiment=wide_ep_decode"] + ROUND4)
    off = cost_model(cfg)
    r = off.step_breakdown(step)
    assert off.fluctuation is None
    assert 8 * run["tokens_per_device"] / r["total_s"] == cell["value"]              # exactly round 4
    assert r["moe_rank_imbalance"] == cell["breakdown"]["moe_rank_imbalance"]
    on = COST.build(cfg.sim.cost.name, replace(cfg.sim.cost, expert_load_fluctuation=fit["inflation"]),
                    cost_instance(cfg))
    picks = run["tokens_per_device"] * run["ep"] * run["top_k"]
    assert on.fluctuation.balancedness(picks) == pytest.approx(fit["moe_layers_mean"], abs=0.002)
    busiest = on.step_breakdown(step)["moe_rank_imbalance"]
    # the mean of max / mean over draws is at least 1 / the mean of mean / max (Jensen), and close to it
    assert 1 / fit["moe_layers_mean"] - 0.002 <= busiest <= 1.01 / fit["moe_layers_mean"]
    assert busiest > r["moe_rank_imbalance"] + 0.1 and on.step_time(step) > off.step_time(step)


def test_a_draws_shares_vary_by_inflation_times_independent_picks():
    layers, inflation, picks = 60, 4.0, 1000       # 60 identical layers x 64 draws: the variance within ~5%
    f = LoadFluctuation([[3.0, 1.0]] * layers, [[0, 1]] * layers, 2, inflation, seed=7)
    rank0 = f.rank_loads(picks)[:, :, 0].ravel()
    assert rank0.mean() == pytest.approx(0.75, abs=0.005)
    assert rank0.var() == pytest.approx(inflation * 0.75 * 0.25 / picks, rel=0.1)


def test_the_busiest_rank_nears_the_average_as_the_batch_grows_and_prices_the_same_every_time():
    loads = [[4.0, 3.0, 2.0, 1.0, 1.0, 2.0, 3.0, 4.0]] * 8
    placement = [[0, 3, 1, 2, 4, 7, 5, 6]] * 8                       # 4 ranks of 2 slots, 5 of the 20 shares each
    f = LoadFluctuation(loads, placement, 4, 8.0, seed=0)
    assert f.imbalance(0) == pytest.approx(1.0)                       # no batch drawn: the loads' own balance
    skewed = LoadFluctuation(loads, [list(range(8))] * 8, 4, 8.0, seed=0)
    assert skewed.imbalance(0) == pytest.approx(7 / 20 * 4)           # experts 0 and 1 on one rank: 7 of 20
    by_batch = [f.imbalance(p) for p in (100, 1_000, 10_000, 1_000_000)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[-1] == pytest.approx(1.0, abs=0.01)
    assert by_batch[0] > 1.2
    assert LoadFluctuation(loads, placement, 4, 8.0, seed=0).imbalance(1_000) == by_batch[1]   # seeded


def test_bad_sizes_and_placements_are_refused():
    with pytest.raises(ValueError, match="inflation > 0"):
        LoadFluctuation([[1.0, 1.0]], [[0, 1]], 2, 0.0, seed=0)
    with pytest.raises(ValueError, match="every expert at least once"):
        LoadFluctuation([[1.0, 1.0]], [[0, 0]], 2, 1.0, seed=0)
    with pytest.raises(ValueError, match="expert_load_fluctuation=-1.0 must be >= 0"):
        cost_model(compose(["experiment=wide_ep_decode", "parallel.size=16", "sim.cost.expert_load_fluctuation=-1"]))


@pytest.mark.long
def test_the_fit_rewrites_the_committed_size_exactly():
    path = WIDE_EP / "loads" / "sglang_blog_decode_balancedness.json"
    before = path.read_bytes()
    done = subprocess.run([sys.executable, str(WIDE_EP / "fit_load_fluctuation.py")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert path.read_bytes() == before
