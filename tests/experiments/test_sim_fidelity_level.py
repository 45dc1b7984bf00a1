"""experiments/sim_fidelity --host-scale level: a cell's level read from a run of it at another draw (read_level),
checked on the real simulator: the level read from a block reproduces that block's own step CPU (one rank, per
kind) or duration (two ranks); --resimulate reads each case's level from its own stored block; workload.seed, the
other draw, leaves the weights' seed alone; and the switches a level cannot be read under are refused."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from framework.config import compose
from framework.core.registry import WORKLOAD
from framework.runs.sim import simulate
from framework.core.paths import REPO_ROOT as ROOT
from script_loader import load_script

SIM = ["mode=sim", "sim.cost=calibrated", "sim.host_cores=2", "sim.host_sharing=fair"]
ONE_RANK = ["workload=multi_turn", "workload.num_conversations=6", "workload.turns=2", "workload.user_len=48",
            "workload.output_len=6", "workload.max_concurrency=3", "cluster.instances=2", "logger.mode=disabled"]
TWO_RANKS = ["workload=multi_turn", "workload.num_conversations=6", "workload.turns=1", "workload.user_len=8",
             "workload.output_len=12", "workload.max_concurrency=0", "parallel=tp", "parallel.size=2",
             "moe=triton_fused", "engine.radix_cache=false", "logger.mode=disabled", "cluster.http=false"]


def test_a_one_rank_level_is_the_engines_step_cpu_over_the_price_per_kind_and_reproduces_it():
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.3, None)
    plain, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load))
    real = {"extend_cpu_s": 0.8 * plain["extend_cpu_s"], "decode_cpu_s": 1.3 * plain["decode_cpu_s"],
            "duration_s": plain["duration_s"]}
    level = f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, real)])
    assert level["by"] == "step_cpu"
    again, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load, level=level))
    for key in ("extend_cpu_s", "decode_cpu_s"):          # the batches may move a little with the new speed
        assert again[key] == pytest.approx(real[key], rel=0.05)
    with pytest.raises(ValueError, match=r"c's level block has no decode steps"):
        f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, {**real, "decode_cpu_s": None})])
    floored = f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, {**real, "extend_cpu_s": 0.0})])
    assert floored["extend"] == f.MIN_LEVEL


def test_a_two_rank_level_is_the_scale_at_which_the_block_lasts_as_long_as_it_did():
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.2, None)
    slow, _ = simulate(f.sim_config("dp_attn_vs_tp", TWO_RANKS, SIM, load, (1.6, None, None)))
    level = f.read_level("tpx2", "dp_attn_vs_tp", SIM, [(TWO_RANKS, load, {"duration_s": slow["duration_s"]})])
    assert level["by"] == "duration" and level["extend"] == level["decode"] == pytest.approx(1.6, rel=0.05)
    floor = f.read_level("tpx2", "dp_attn_vs_tp", SIM, [(TWO_RANKS, load, {"duration_s": 1e-3})])   # below its waits
    assert floor["decode"] == f.MIN_LEVEL


def test_two_blocks_are_read_as_one_and_a_run_without_the_blocks_asked_for_is_refused(tmp_path):
    """--level-blocks before after: the blocks before and after a judged run read as one, their seconds summed (not
    their levels averaged): a short block (one turn) and a long one (three) priced at 0.6 and 1.4 read the summed
    CPU over the summed price, the one-rank kinds and the two-rank duration alike. A stored run of round M's (blocks
    before only) re-reads its blocks before and cannot be re-read with blocks after."""
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.2, None)
    for study, overrides in (("router_ablation", ONE_RANK), ("dp_attn_vs_tp", TWO_RANKS)):
        blocks, reals, priced = {}, [], []
        for which, seed, scale, turns in (("before", 1000, 0.6, 1), ("after", 2000, 1.4, 3)):
            seeded = overrides + [f"workload.seed={seed}", f"workload.turns={turns}"]
            real, _ = simulate(f.sim_config(study, seeded, SIM, load, (scale, None, None)))
            blocks[which] = f.level_block(seeded, real, {"host_background": load[0], "host_steal": None})
            reals.append(real)
            priced.append(simulate(f.sim_config(study, seeded, SIM, load))[0])
        both = f.with_level("c", blocks, study, SIM, False)
        if study == "router_ablation":
            for kind in ("extend", "decode"):
                key = f"{kind}_cpu_s"
                assert both[kind] == pytest.approx(sum(r[key] for r in reals) / sum(p[key] for p in priced))
            mean = statistics.fmean(f.with_level("c", {w: b}, study, SIM, False)["decode"] for w, b in blocks.items())
            assert both["decode"] != pytest.approx(mean, rel=0.02)     # not the levels' mean: the blocks differ
        else:
            again = [simulate(f.sim_config(study, b["overrides"], SIM, load, (both["decode"], None, None)))[0]
                     for b in blocks.values()]          # the summed durations, reproduced at the pooled scale
            assert sum(a["duration_s"] for a in again) == pytest.approx(sum(r["duration_s"] for r in reals),
                                                                        rel=0.05)
        record = f._level_record(blocks, both, (1.0, None, None))
        assert f.stored_blocks(record, ["before", "after"]) == blocks
    stored = tmp_path / "results.json"
    block = {"overrides": ONE_RANK, "real": {"extend_cpu_s": 1.0, "decode_cpu_s": 1.0, "duration_s": 1.0},
             "host_background": 0.0, "host_steal": None}
    stored.write_text(json.dumps({"runs": [[{"case": "c", "level_block": block}]], "cases": [],
                                  "host_scale": "level", "sim_args": []}))
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--resimulate", str(stored),
                        "--host-scale", "level", "--level-blocks", "before", "after"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "did not run those level blocks (it ran with --host-scale level, level blocks " \
        "before)" in r.stderr
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--resimulate", str(stored),
                        "--host-scale", "level", "--level-blocks", "before"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "did not run those level blocks" not in r.stderr          # the blocks before: read (past the check)
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--level-blocks", "after"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "level blocks are read only with --host-scale level" in r.stderr


def test_workload_seed_draws_other_prompts_and_keeps_the_runs_seed_elsewhere():
    def prompts(overrides):
        cfg = compose(["workload=multi_turn", "workload.num_conversations=3"] + overrides)
        return cfg, [t.text for s in WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
                     for t in s.turns]
    base, drawn = prompts([])
    cfg, other = prompts(["workload.seed=1000"])
    assert other != drawn and cfg.seed == base.seed == 0             # another draw; the weights' seed unchanged
    assert prompts(["workload.seed=1000", "seed=7"])[1] == other      # the draw is workload.seed's alone
    assert prompts(["seed=1000"])[1] == other                         # unset: the run's seed draws, as before


def test_resimulate_reads_each_cases_level_from_its_own_stored_block_and_reproduces_its_simulation():
    """Two cells of one study, each with a level block whose "real" figures are a simulation at a known level: each
    is re-simulated at its own block's level, as the run simulated it."""
    f = load_script("experiments/sim_fidelity/run.py")
    load, cases, runs = (0.1, None), [], []
    for case, router, slow in (("multi_turn/round_robin", "round_robin", 0.7), ("multi_turn/cache_aware",
                                                                               "cache_aware", 1.4)):
        overrides = ONE_RANK + [f"router={router}"]
        seeded = overrides + ["workload.seed=1000"]
        block_real, _ = simulate(f.sim_config("router_ablation", seeded, SIM, load, (slow, None, None)))
        block = f.level_block(seeded, block_real, {"host_background": load[0], "host_steal": None})
        level = f.with_level(case, {"before": block}, "router_ablation", SIM, False)
        judged, _ = simulate(f.sim_config("router_ablation", overrides, SIM, load, level=level))
        cases.append({"case": case, "study": "router_ablation", "overrides": overrides})
        runs.append({"case": case, "host_background": load[0], "host_steal": None, "level_block": block,
                     "real": {k: judged.get(k) for k in f.KEEP}})
    stored = {"cases": cases, "runs": [runs], "load_average": {"before": [0.5], "after": [0.5], "cores": 2}}
    cells, table = f.resimulate(stored, SIM, level_blocks=["before"])
    for cell, slow in zip(cells, (0.7, 1.4)):
        level, = cell["host_levels"]
        # priced at `slow`, read back at it (the batches of another speed move a little)
        assert level["extend"] == pytest.approx(slow, rel=0.05) and level["decode"] == pytest.approx(slow, rel=0.05)
        assert cell["host_scales"] == [level["decode"]]
        needed, = cell["levels_needed"]       # the judged run was simulated at its block's level: it needed that
        assert needed["extend"] == pytest.approx(level["extend"], rel=0.05)
        assert needed["decode"] == pytest.approx(level["decode"], rel=0.05)
        assert [cell["sim_spread"][k]["median"] for k in f.tables.JUDGED] == [cell["real_spread"][k]["median"]
                                                                        for k in f.tables.JUDGED]
    assert "judged runs needed" in f.tables.level_table(cells)
    for cell in cells:                    # the turns' TTFT, real against simulated (here the same simulation)
        real, sim = cell["ttft_by_turn"]["real"], cell["ttft_by_turn"]["sim"]
        assert list(real) == list(sim) == ["0", "1"] and list(real.values()) == pytest.approx(list(sim.values()),
                                                                                            rel=0.05)
    assert "multi_turn/cache_aware | " in f.tables.turn_table(cells) and "| 0: " in f.tables.turn_table(cells)


def test_needed_level_reads_the_judged_run_not_its_block():
    f = load_script("experiments/sim_fidelity/run.py")
    load, measured = (0.1, None), {"host_background": 0.1, "host_steal": None}
    block_real, _ = simulate(f.sim_config("router_ablation", ONE_RANK + ["workload.seed=1000"], SIM, load,
                                          (0.7, None, None)))
    level = f.with_level("c", {"before": f.level_block(ONE_RANK + ["workload.seed=1000"], block_real, measured)},
                         "router_ablation", SIM, False)
    judged, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load, (1.2, None, None)))
    needed = f.needed_level(level, "c", "router_ablation", ONE_RANK, judged, measured, SIM, False)
    assert level["decode"] == pytest.approx(0.7, rel=0.05) and needed["decode"] == pytest.approx(1.2, rel=0.05)
    assert needed["extend"] == pytest.approx(1.2, rel=0.05)
    assert f.needed_level(None, "c", "router_ablation", ONE_RANK, judged, measured, SIM, False) is None


def test_contention_busy_measured_is_the_siblings_and_one_and_only_with_engine_contention():
    import argparse
    f = load_script("experiments/sim_fidelity/run.py")
    args = argparse.Namespace(profile="p.json", between="grid", point="median", extend="batch", prefix_regime="smooth",
                              serving="measured", sharing="fair", contention="engine", contention_busy="measured",
                              batch_arrivals=False, level_waits="unscaled")
    cores = {"decode": 1.25, "extend": 1.05, "siblings": 3}
    assert "sim.host_contention_busy=4" in f.switches(args, cores)
    args.contention_busy = "cores"
    assert not any(a.startswith("sim.host_contention_busy") for a in f.switches(args, cores))
    assert "sim.batch_arrivals=true" not in f.switches(args, cores)
    args.batch_arrivals = True                       # --batch-arrivals (round N)
    assert "sim.batch_arrivals=true" in f.switches(args, cores)
    assert "sim.cost.host_scale_waits=true" not in f.switches(args, cores)
    args.level_waits = "scaled"                      # --level-waits scaled (round Q)
    assert "sim.cost.host_scale_waits=true" in f.switches(args, cores)
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--contention-busy", "measured"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "only --contention engine" in r.stderr


def test_a_level_with_a_contention_factor_is_refused():
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--host-scale", "level", "--contention",
                        "1.2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "give --contention none" in r.stderr


def test_a_two_rank_level_with_block_collectives_is_read_at_the_latency_measured_around_each_block():
    """--host-scale level --collectives block (round Q): a two-rank block that ran at 1.6x the profile's compute with
    collectives of 1 ms each (the profile's: about 2) reads 1.6 when simulated at the latency measured around it, and
    more without it (its waits priced dearer, its compute read faster); a block that took no latency is refused."""
    f = load_script("experiments/sim_fidelity/run.py")
    load, latency = (0.2, None), 0.001
    split = SIM + ["sim.cost.path=data/calibration/cpu_amd_epyc_l.json"]     # a profile with its waits apart
    slow, _ = simulate(f.sim_config("dp_attn_vs_tp", TWO_RANKS, split, load, (1.6, None, latency)))
    measured = {"host_background": 0.2, "host_steal": None, "host_collective_s": [0.0009, 0.0011]}
    block = {"before": f.level_block(TWO_RANKS, {"duration_s": slow["duration_s"]}, measured)}
    level = f.with_level("tpx2", block, "dp_attn_vs_tp", split, False, collectives=True)
    assert level["by"] == "duration" and level["decode"] == pytest.approx(1.6, rel=0.05)
    assert f.with_level("tpx2", block, "dp_attn_vs_tp", split, False)["decode"] < 1.5    # at the profile's latency
    block["before"]["host_collective_s"] = None
    with pytest.raises(ValueError, match="tpx2's level blocks took no collective latency around them"):
        f.with_level("tpx2", block, "dp_attn_vs_tp", split, False, collectives=True)
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--collectives", "block", "--level-waits",
                        "scaled"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "give one of them" in r.stderr


def test_outside_level_adds_the_blocks_time_outside_the_engines_before_them(tmp_path):
    """--outside level: a block whose requests spent 20 ms more outside the engines than its simulation did (the
    TTFT less its engine part) reads outside_s 0.020; simulated with it, the block's requests spend about that long
    outside (the router's time, before the engine); a block without the TTFT's split is refused, saying why; a stored
    run's blocks are filled in from the work folder's full figures only when they are that run's."""
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.0, None)
    plain, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load))
    gap = plain["ttft_mean_ms"] - plain["engine_ttft_ms_mean"]
    real = {**{k: plain[k] for k in f.LEVEL_KEEP}, "ttft_mean_ms": plain["ttft_mean_ms"] + 20.0}
    level = f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, real)], outside="level")
    assert level["outside_s"] == pytest.approx(0.020)
    assert "outside_s" not in f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, real)])
    cfg = f.sim_config("router_ablation", ONE_RANK, SIM, load, level=level)
    assert cfg.sim.router_overhead_s == pytest.approx(0.0208)
    again, _ = simulate(cfg)
    assert again["ttft_mean_ms"] - again["engine_ttft_ms_mean"] == pytest.approx(gap + 20.0, abs=2.0)
    with pytest.raises(ValueError, match=r"c's level blocks did not keep \['engine_ttft_ms_mean'\]"):
        f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, {**real, "engine_ttft_ms_mean": None})],
                     outside="level")
    # a stored run of round N's kind: its level block lacks the split; the work folder's figures fill it in
    block = {"overrides": ONE_RANK, "real": {**real, "ttft_mean_ms": None, "engine_ttft_ms_mean": None},
             "host_background": 0.0, "host_steal": 0.0}
    stored = {"runs": [[{"case": "multi_turn/round_robin", "level_block": block}]]}
    folder = tmp_path / "repeat0" / "level" / "router_ablation"
    folder.mkdir(parents=True)
    trial = {"workload": "multi_turn", "router": "round_robin", **real}
    (folder / "results.json").write_text(json.dumps({"overrides": {"multi_turn": []}, "trials": [trial]}))
    f.fill_outside(stored, tmp_path, ["before"])
    assert block["real"]["ttft_mean_ms"] == real["ttft_mean_ms"]
    block["real"]["ttft_mean_ms"] = None
    block["real"]["extend_cpu_s"] += 1.0                       # not this run's block: refused
    with pytest.raises(SystemExit, match="another run wrote over --work"):
        f.fill_outside(stored, tmp_path, ["before"])


def test_outside_load_reads_the_gap_as_a_wait_for_busy_cores_and_refuses_idle_blocks():
    """--outside load: a block whose requests spent 20 ms more outside the engines than its simulation did reads the
    sim.outside_busy_s at which its simulation spends those 20 ms more outside (each request the wait at the cores'
    busy share at its send; more than 20 ms over the share without it, as the later arrivals leave the cores idler),
    none of it in the router's constant; one that spent less reads 0; blocks sent
    one request at a time (the cores idle at every send) are refused, saying why; sim.outside_busy_s below 0, without
    sim.host_cores or without HTTP is refused."""
    f = load_script("experiments/sim_fidelity/run.py")
    load = (0.0, None)
    plain, _ = simulate(f.sim_config("router_ablation", ONE_RANK, SIM, load))
    share, gap = plain["sim_send_busy_share"], plain["ttft_mean_ms"] - plain["engine_ttft_ms_mean"]
    assert 0.2 < share <= 1.0
    real = {**{k: plain[k] for k in f.LEVEL_KEEP}, "ttft_mean_ms": plain["ttft_mean_ms"] + 20.0}
    level = f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, real)], outside="load")
    assert "outside_s" not in level and level["outside_busy_s"] > 0.020 / share    # later arrivals: idler cores
    cfg = f.sim_config("router_ablation", ONE_RANK, SIM, load, level=level)
    assert cfg.sim.router_overhead_s == pytest.approx(0.0008) and cfg.sim.outside_busy_s == level["outside_busy_s"]
    again, _ = simulate(cfg)
    assert again["ttft_mean_ms"] - again["engine_ttft_ms_mean"] == pytest.approx(gap + 20.0, abs=f.OUTSIDE_TOL_MS)
    assert again["sim_send_busy_share"] < share
    below = f.read_level("c", "router_ablation", SIM, [(ONE_RANK, load, {**real, "ttft_mean_ms": real["ttft_mean_ms"]
                                                                          - 25.0})], outside="load")
    assert below["outside_busy_s"] == 0.0          # the simulation already spends longer outside: none added
    one = ONE_RANK + ["workload.max_concurrency=1"]
    idle, _ = simulate(f.sim_config("router_ablation", one, SIM, load))
    assert idle["sim_send_busy_share"] == 0.0
    with pytest.raises(ValueError, match="c's level blocks kept the cores 0.000 busy at the sends"):
        f.read_level("c", "router_ablation", SIM, [(one, load, {**{k: idle[k] for k in f.LEVEL_KEEP},
                                                                "ttft_mean_ms": idle["ttft_mean_ms"] + 5.0})],
                     outside="load")
    with pytest.raises(ValueError, match=r"sim.outside_busy_s=0.01 needs sim.host_cores > 0"):
        simulate(compose(ONE_RANK + SIM + ["sim.host_cores=0", "sim.outside_busy_s=0.01"]))
    with pytest.raises(ValueError, match=r"sim.outside_busy_s=-0.01 must be >= 0"):
        simulate(compose(ONE_RANK + SIM + ["sim.outside_busy_s=-0.01"]))
    with pytest.raises(ValueError, match=r"cluster.http=false \(the in-process driver\) has none"):
        simulate(compose(TWO_RANKS + SIM + ["sim.outside_busy_s=0.01"]))


def test_outside_spread_draws_each_requests_time_outside_as_spread_as_the_blocks_were():
    """--outside spread: a block whose requests' times outside the engines spread 10 ms (sd) reads the sim.outside_cv
    whose draws, added to the busy share's own swing, spread the simulation's as much (the mean about load's: the
    draws move the arrivals); the judged cell draws from its repeat's stream (the same draw, the same run; another,
    another run), and a block that spread no more than its simulation reads 0; a block without the per-request
    spread (a run before round R, or NaN: none reported) is refused, saying which; sim.outside_cv below 0, NaN, above
    its ceiling or without HTTP is refused."""
    f = load_script("experiments/sim_fidelity/run.py")
    load, cell = (0.0, None), ONE_RANK + ["workload.num_conversations=32", "workload.max_concurrency=8"]   # 64 requests
    plain, _ = simulate(f.sim_config("router_ablation", cell, SIM, load))
    assert plain["outside_sd_ms"] < 3.0
    real = {**{k: plain[k] for k in f.LEVEL_KEEP}, "ttft_mean_ms": plain["ttft_mean_ms"] + 10.0,
            "outside_mean_ms": plain["outside_mean_ms"] + 10.0, "outside_sd_ms": 10.0}
    level = f.read_level("c", "router_ablation", SIM, [(cell, load, real)], outside="spread")
    assert level["outside_busy_s"] >= 0 and 0.5 < level["outside_cv"]
    drawn = [simulate(f.sim_config("router_ablation", cell, SIM, load, level=level, draw=k))[0] for k in (0, 0, 1)]
    assert drawn[0]["outside_sd_ms"] == drawn[1]["outside_sd_ms"] != drawn[2]["outside_sd_ms"]
    assert 8.0 < statistics.fmean(d["outside_sd_ms"] for d in drawn) < 13.0
    assert statistics.fmean(d["outside_mean_ms"] for d in drawn) == pytest.approx(real["outside_mean_ms"], rel=0.25)
    narrow = f.read_level("c", "router_ablation", SIM, [(cell, load, {**real, "outside_sd_ms": 0.5})],
                          outside="spread")
    assert narrow["outside_cv"] == 0.0
    for kept in (None, float("nan")):         # a run before round R; a worker that reports no engine_ttft_s
        with pytest.raises(ValueError, match=r"c's level blocks did not keep a spread .*outside_sd_ms"):
            f.read_level("c", "router_ablation", SIM, [(cell, load, {**real, "outside_sd_ms": kept})],
                         outside="spread")
    for bad in ("-0.5", "nan", "11.0"):      # (a gamma draw at NaN never returns)
        with pytest.raises(ValueError, match=rf"sim.outside_cv={bad} must be between 0 .* and 10.0"):
            simulate(compose(ONE_RANK + SIM + [f"sim.outside_cv={bad}"]))
    with pytest.raises(ValueError, match=r"sim.outside_cv=0.5: .* cluster.http=false"):
        simulate(compose(TWO_RANKS + SIM + ["sim.outside_cv=0.5"]))


def test_outside_level_is_refused_without_level_blocks_and_fills_the_block_after_too(tmp_path):
    f = load_script("experiments/sim_fidelity/run.py")
    r = subprocess.run([sys.executable, "experiments/sim_fidelity/run.py", "--outside", "level"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "only --host-scale level runs" in r.stderr
    real = {"extend_cpu_s": 1.0, "decode_cpu_s": 0.5, "duration_s": 3.0, "ttft_mean_ms": None,
            "engine_ttft_ms_mean": None}
    after = {"overrides": [], "real": dict(real), "host_background": 0.0, "host_steal": 0.0}
    stored = {"runs": [[{"case": "shared_prefix/cache_aware", "level_block_after": after}]]}
    folder = tmp_path / "repeat0" / "level_after" / "router_ablation"
    folder.mkdir(parents=True)
    trial = {"workload": "shared_prefix", "router": "cache_aware", **real, "ttft_mean_ms": 70.0,
             "engine_ttft_ms_mean": 58.0}
    (folder / "results.json").write_text(json.dumps({"overrides": {"shared_prefix": []}, "trials": [trial]}))
    f.fill_outside(stored, tmp_path, ["before", "after"])
    assert (after["real"]["ttft_mean_ms"], after["real"]["engine_ttft_ms_mean"]) == (70.0, 58.0)
