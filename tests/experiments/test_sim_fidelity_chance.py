"""experiments/sim_fidelity's range test (tables.py), and what it can say at a repeat count: a bias-free simulator's chance
of landing inside n real repeats' range is 1 - 2^(1-n) per varying figure; where each simulated median fell among
the real repeats is counted."""
from __future__ import annotations

from script_loader import load_script


def runs(real: list[dict], sim: list[dict]) -> list[list[dict]]:
    return [[{"case": "c", "study": "s", "overrides": [], "real": r, "sim": m, "host_background": 0.0}]
            for r, m in zip(real, sim)]


def test_where_the_simulated_median_falls_and_the_chance_of_a_bias_free_one():
    f = load_script("experiments/sim_fidelity/tables.py")
    tput, ttft, hit = f.JUDGED
    real = [{tput: t, ttft: 100.0 + t, hit: 0.0} for t in (10.0, 12.0, 14.0, 16.0, 18.0)]
    sim = [{tput: t, ttft: 50.0, hit: 0.0} for t in (13.0, 15.0, 17.0, 19.0, 20.0)]
    cell, = f.combine(runs(real, sim))
    assert cell["real_below_sim"] == {tput: 4, ttft: 0, hit: 0}     # 17 is above 10, 12, 14, 16; 50 below them all
    assert cell["inside_real_range"] == {tput: True, ttft: False, hit: True}
    line = f.chance_line([cell])
    # two varying figures (the hit rate is 0 in every real run), 5 repeats each: (1 - 2^-4)^2
    assert "2 varying figures, n = 5-5 repeats: all at once 88%" in line and "c 4/0/0" in line
    three, = f.combine(runs(real[:3], sim[:3]))
    assert "n = 3-3 repeats: all at once 56%" in f.chance_line([three])      # 0.75^2
