"""experiments/routing_study smoke-runs at tiny size (servelab's exact-view policy beside cache_aware, and SGLang's
router when installed) and writes its table's figures and one plot per workload; its hit-rate ceiling is checked
against brute force."""
import json
import random
import statistics
import subprocess
import sys

import pytest

from cluster_helpers import ROOT
from framework.cluster.peer_router import installed_version
from framework.contracts.workload import Session, Turn
from script_loader import load_script

hit_rate_ceiling = load_script("experiments/routing_study/ceiling.py").hit_rate_ceiling


@pytest.mark.slow
def test_routing_study_quick(tmp_path):
    """Slow (35 s). The exact view brackets the workers' hit rate: its estimate without in-flight credits (what the
    caches held at the decision) is a floor, the estimate with them (what they will hold once the requests in flight
    before this one are prefilled) a ceiling. Which one the truth meets is timing: with 6 requests, an agent step
    whose tool prefix is still being prefilled for another session when it arrives joins that prefill batch and
    misses (0.07 of the hit rate). The estimate itself is checked deterministically in tests/sim and over real
    workers in tests/serving/test_router_kv_events.py."""
    contenders = ["precise_prefix", "cache_aware"] + (["cache_aware/sglang"] if installed_version() else [])
    r = subprocess.run([sys.executable, "experiments/routing_study/run.py", "--quick", "--out", str(tmp_path),
                        "--workloads", "multi_turn", "agent", "--contenders", *contenders],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    print(r.stdout)
    out = json.loads((tmp_path / "results.json").read_text())
    rows = {(x["workload"], x["contender"]): x for x in out["rows"]}
    assert set(rows) == {(w, c) for w in ("multi_turn", "agent") for c in contenders}
    for row in rows.values():
        assert row["requests_completed"] == 6 and row["requests_failed"] == 0
        assert 0 < row["cache_hit_rate"] <= row["ceiling_hit_rate"] + 1e-9
    for w in ("multi_turn", "agent"):  # within a partly cached block per request of the bracket
        row = rows[w, "precise_prefix"]
        floor, ceiling = row["router_confirmed_hit_rate"], row["router_estimated_hit_rate"]
        assert floor - 0.02 <= row["cache_hit_rate"] <= ceiling + 0.02, row
        assert (tmp_path / "plots" / f"{w}.png").stat().st_size > 10_000
    assert "exact view |estimate - measured|" in r.stdout


def brute_ceiling(sessions) -> float:
    held, answers, hit, total = [], [[] for _ in sessions], 0, 0
    for _, i, k in sorted((s.arrival_s, i, k) for i, s in enumerate(sessions) for k in range(len(s.turns))):
        prompt = sessions[i].prompt(k, answers[i])
        best = max((next((j for j, (a, b) in enumerate(zip(prompt, h)) if a != b), min(len(prompt), len(h)))
                    for h in held), default=0)
        hit, total = hit + min(best, len(prompt) - 1), total + len(prompt)
        answers[i].append(f"\x00{i}.{k}\x00".ljust(sessions[i].turns[k].max_new_tokens, "\x01"))
        held.append(prompt + answers[i][-1])
    return hit / total


def test_ceiling_is_the_longest_prefix_of_anything_held_before():
    rng = random.Random(0)
    for _ in range(30):
        sessions = [Session(f"s{i}", rng.choice([0.0, 1.0, 2.0]),
                            [Turn("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))), rng.randint(1, 4))
                             for _ in range(rng.randint(1, 3))], prefix=rng.choice(["", "sys", "sy"]),
                            carry_history=rng.random() < 0.5) for i in range(rng.randint(1, 6))]
        assert abs(hit_rate_ceiling(sessions) - brute_ceiling(sessions)) < 1e-12


@pytest.mark.long
def test_routing_study_sim_quick(tmp_path):
    """--mode sim: the same rows per cluster size, SGLang's rows by their stand-ins, the exact view's estimate close."""
    r = subprocess.run([sys.executable, "experiments/routing_study/run.py", "--mode", "sim", "--quick", "--out",
                        str(tmp_path), "--instances", "2", "4", "--workloads", "multi_turn", "--contenders",
                        "precise_prefix", "round_robin", "cache_aware/sglang"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "results_sim.json").read_text())
    rows = {(x["workload"], x["contender"]): x for x in out["rows"]}
    assert set(rows) == {(f"multi_turn x{n}", c) for n in (2, 4)
                         for c in ("precise_prefix", "round_robin", "cache_aware/sglang")}
    for (w, c), row in rows.items():
        assert row["mode"] == "sim" and row["requests_failed"] == 0 and row["requests_completed"] > 0
        assert 0 < row["cache_hit_rate"] <= row["ceiling_hit_rate"] + 1e-9
        assert row["stand_in"] == ("router=cache_aware_v2" if c == "cache_aware/sglang" else None)
    assert {row["instances"] for row in rows.values()} == {2, 4}
    assert abs(rows["multi_turn x4", "precise_prefix"]["estimate_error"]) < 0.02
    assert (tmp_path / "table_sim.md").read_text().startswith("**multi_turn x2**")


def test_pool_separates_a_real_difference_from_noise(tmp_path):
    """pool.py: two contenders drawn from one distribution are not told apart (p large, P(a better) near 0.5); shifted
    by more than the spread, they are (p small, P(a better) 1 or 0 as the metric's direction says)."""
    pool = load_script("experiments/routing_study/pool.py")
    better_share, compare, permutation_p = pool.better_share, pool.compare, pool.permutation_p
    rng = random.Random(0)
    same_a, same_b = [rng.gauss(0.6, 0.03) for _ in range(10)], [rng.gauss(0.6, 0.03) for _ in range(10)]
    assert permutation_p(same_a, same_b) > 0.05
    assert 0.25 < better_share(same_a, same_b, True) < 0.75
    shifted = [x + 0.2 for x in same_b]
    assert permutation_p(shifted, same_b) < 0.01
    assert better_share(shifted, same_b, True) == 1.0 and better_share(shifted, same_b, False) == 0.0

    def trial(c, hit, p99):
        return {"workload": "w", "contender": c, "cache_hit_rate": hit, "ttft_p99_ms": p99,
                "output_throughput_tok_s": 100.0, "router_estimated_hit_rate": hit + 0.01}
    trials = [trial("a", x + 0.2, 900.0 + i) for i, x in enumerate(same_b)] + [
        trial("b", x, 1000.0 + i) for i, x in enumerate(same_b)]
    (row,) = compare(trials, "a", "b")
    assert row["repeats"] == {"a": 10, "b": 10}
    assert row["hit"]["a_better_share"] == 1.0 and row["TTFT p99 ms"]["a_better_share"] == 1.0
    assert row["out tok/s"]["a_better_share"] == 0.5 and row["out tok/s"]["p"] == 1.0
    assert abs(row["a_estimate_error"]["median"] - 0.01) < 1e-9
    run = {"mode": "real", "git_sha": "x", "repeats": 10, "trials": trials}
    (tmp_path / "results.json").write_text(json.dumps(run))
    r = subprocess.run([sys.executable, "experiments/routing_study/pool.py", str(tmp_path / "results.json"), "--a",
                        "a", "--b", "b", "--out", str(tmp_path / "pooled.json")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    hit = statistics.median(same_b)
    assert f"| w (10 / 10) | {hit + 0.2:.3f} / {hit:.3f}, 1.00, " in (tmp_path / "pooled.md").read_text()
