"""experiments/pd_splitwise/predict.py --design: Splitwise's other clusters (Figure 18a's Splitwise-HA, Figure 18b's
iso-cost pair) built as splitwise-sim builds them, each machine priced on its own hardware's rows of perf_model.csv
(framework/runs/sim.py build's role_cfgs); the oracle is read here from the CSV's rows. No rate is searched."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import json
import statistics
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import yaml

from framework.config import compose
from framework.contracts.cost import BatchShape, Step, decode_shape
from framework.engine.config import Role
from framework.gpu.hardware import HardwareConfig
from framework.runs.sim import build

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def curve(hardware: str, column: str) -> tuple[list[int], list[float]]:
    """BLOOM-176B at TP 8 on `hardware` (the profile's name): the medians of `column` (s) per batch-token count."""
    by = {}
    with gzip.open(ROOT / "data/splitwise/perf_model.csv.gz", "rt") as f:
        for r in csv.DictReader(f):
            if (r["model"], r["hardware"], r["tensor_parallel"]) == ("bloom-176b", hardware, "8"):
                by.setdefault(int(r["prompt_size"]) * int(r["batch_size"]), []).append(float(r[column]) / 1000)
    xs = sorted(by)
    return xs, [statistics.median(by[x]) for x in xs]


def prefill_step(tokens: int) -> Step:
    return Step((BatchShape("extend", (tokens,), (0,)),))


def decode_step(requests: int) -> Step:
    return Step((decode_shape(requests, 100 * requests),))


def test_splitwise_ha_prices_prompt_machines_on_h100_rows_and_token_machines_on_a100_rows(predict):
    cfg, role_cfgs = predict.configs("splitwise_ha", 5, "mixed_pool")
    sim = build(cfg, predict.sessions(predict.requests(5.0, 2.0, 0), 0), role_cfgs=role_cfgs)
    h100, a100 = curve("h100-80gb", "prompt_time"), curve("a100-80gb", "prompt_time")
    assert h100 != a100
    for name, inst in sim.instances.items():
        hw = "h100-80gb" if sim.pd.roles[name] is Role.prefill else "a100-80gb"
        assert inst.cost.step_time(prefill_step(1500)) == pytest.approx(np.interp(1500, *curve(hw, "prompt_time")))
        assert inst.cost.step_time(decode_step(300)) == pytest.approx(np.interp(300, *curve(hw, "token_time")))
    roles = [sim.pd.roles[n] for n in sim.instances]
    assert roles == [Role.prefill] * 5 + [Role.decode] * 5        # 25 and 26 at 1/5, rounded
    # the same KV pool on both (Splitwise's 80 GiB a GPU on either machine)
    assert len({i.memory.kv_tokens for i in sim.instances.values()}) == 1
    records, _ = sim.run()
    assert records and all(r.ok for r in records) and sim.pd.stats.transfers == len(records)


def test_the_designs_build_splitwise_sims_clusters(predict):
    assert predict.DESIGNS["aa"] == (("baseline", "splitwise"), 5)
    assert predict.DESIGNS["ha"] == (("baseline", "splitwise_ha"), 1)
    assert predict.DESIGNS["isocost"] == (("baseline_h100", "splitwise_aa_isocost"), 1)
    m = predict.machines
    assert m("baseline", 1) == {"mixed": (70, "a100_80g")} and m("baseline", 5) == {"mixed": (14, "a100_80g")}
    assert m("splitwise", 5) == {"prefill": (9, "a100_80g"), "decode": (5, "a100_80g")}
    assert m("splitwise_ha", 1) == {"prefill": (25, "h100_sxm"), "decode": (26, "a100_80g")}
    assert m("baseline_h100", 1) == {"mixed": (40, "h100_sxm")}
    assert m("splitwise_aa_isocost", 1) == {"prefill": (51, "a100_80g"), "decode": (35, "a100_80g")}
    routers = {k: s.router for k, s in predict.SYSTEMS.items()}
    assert routers == {"baseline": "token_jsq", "splitwise": "mixed_pool", "splitwise_ha": "mixed_pool",
                       "baseline_h100": "token_jsq", "splitwise_aa_isocost": "mixed_pool"}
    # an H100's memory is Splitwise's A100's (h100-80gb.yaml, a100-80gb.yaml): the same KV budget
    assert predict.GPU_BYTES_OF == {"a100_80g": 85899345920, "h100_sxm": 85899345920}


def test_the_iso_cost_clusters_compose_on_their_hardware(predict):
    base, none = predict.configs("baseline_h100", 1, "token_jsq")
    assert (base.hardware.name, base.cluster.instances, base.cluster.roles, none) == ("h100_sxm", 40, [], {})
    split, none = predict.configs("splitwise_aa_isocost", 1, "mixed_pool")
    assert (split.hardware.name, split.cluster.instances, none) == ("a100_80g", 86, {})
    assert split.cluster.roles == ["prefill"] * 51 + ["decode"] * 35
    assert base.engine.kv_budget_mb == split.engine.kv_budget_mb


def test_an_unknown_design_is_refused_with_the_known_ones(predict, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="unknown design 'hh'; known: aa, ha, isocost"):
        predict.design_name("hh")
    with pytest.raises(SystemExit):
        predict.main(["--design", "hh"])
    assert "known: aa, ha, isocost" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="add --round 2"):         # the held-out designs run round 2's settings
        predict.main(["--design", "ha"])


@pytest.mark.parametrize("design, baseline, split", [("ha", "baseline_a100", "splitwise_ha"),
                                                     ("isocost", "baseline_h100", "splitwise_aa")])
def test_a_design_writes_its_own_file_that_compare_reads(predict, splitwise_compare, tmp_path, monkeypatch, design,
                                                          baseline, split):
    """predict.py's file for a design (its rate search stubbed: 30 and 45 req/s, not a prediction) and compare.py's
    reading of it; no published figure in predict.py's setup."""
    rates = iter([30, 45])
    monkeypatch.setattr(predict, "max_rate", lambda *a, **k: (next(rates), []))
    monkeypatch.setattr(predict, "HERE", tmp_path)
    predict.main(["--round", "2", "--design", design])
    out = json.loads((tmp_path / f"predictions_round2_{design}.json").read_text())
    assert out["predicted"] == {f"{baseline}_req_s": 30, f"{split}_req_s": 45, f"{split}_over_{baseline}": 1.5}
    assert out["design"] == design and out["scale"] == 1 and list(out["systems"]) == [baseline, split]
    assert out["router"] == {baseline: "token_jsq", split: "mixed_pool"}
    published = splitwise_compare.PUBLISHED_DESIGNS[design]
    (ratio,) = [v for k, v in published.items() if k.endswith(f"_over_{baseline}")]
    setup = json.dumps(out["setup"]) + json.dumps(out["deviations"])
    assert f"{ratio}x" not in setup and f"{ratio:.2f}" not in setup
    monkeypatch.setattr(splitwise_compare, "HERE", tmp_path)
    assert splitwise_compare.main(["--round", "2", "--design", design]) == 0
    cmp = json.loads((tmp_path / f"comparison_round2_{design}.json").read_text())
    assert cmp["ratio_error"] == pytest.approx(1.5 / ratio - 1) and cmp["prediction_file"].endswith(f"_{design}.json")


def _small():
    return compose(["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=4",
                    "cluster.instances=2", "cluster.roles=[prefill,decode]"])


def test_a_role_config_is_refused_where_the_simulation_keeps_one_of_a_kind():
    cfg = _small()
    with pytest.raises(ValueError, match="roles no instance has: \\['mixed'\\]"):
        build(cfg, [], role_cfgs={Role.mixed: cfg})
    other_model = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=cfg.model.num_layers + 1))
    with pytest.raises(ValueError, match="keep the run's model"):
        build(cfg, [], role_cfgs={Role.prefill: other_model})
    a100 = yaml.safe_load((ROOT / "conf/hardware/a100_80g.yaml").read_text())
    a100.pop("defaults")
    assert cfg.hardware.name == "h100_sxm"           # the roofline prices NVLink and NICs per GPU: A100's differ
    with pytest.raises(ValueError, match="prices KV links unlike"):
        build(cfg, [], role_cfgs={Role.prefill: dataclasses.replace(cfg, hardware=HardwareConfig(**a100))})
