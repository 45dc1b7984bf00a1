"""sim.cost=splitwise_profile: Splitwise's step-time model priced from its profile (data/splitwise/perf_model.csv.gz).
The oracle is read here from the CSV's own rows (the medians per batch-token count, numpy's interpolation between
them, the line through the end points beyond them): a cost model that prices steps any other way fails."""
from __future__ import annotations

import csv
import dataclasses
import gzip
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from framework.contracts.cost import BatchShape, InstanceShape, Step, decode_shape
from framework.core.errors import UserError
from framework.core.registry import COST
from framework.gpu.hardware import HardwareConfig
from framework.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def conf(group: str, name: str) -> dict:
    d = yaml.safe_load((ROOT / f"conf/{group}/{name}.yaml").read_text())
    d.pop("defaults", None)
    return d


@pytest.fixture(scope="module")
def shape():
    """BLOOM-176B's stand-in on a DGX-A100 at TP 8, as the run's config files give them (no compose: fast)."""
    return InstanceShape(ModelConfig(**conf("model", "bloom176b_mla")), HardwareConfig(**conf("hardware", "a100_80g")),
                         "tp", 8, "reference")


@pytest.fixture(scope="module")
def rows():
    with gzip.open(ROOT / "data/splitwise/perf_model.csv.gz", "rt") as f:
        return [r for r in csv.DictReader(f)
                if (r["model"], r["hardware"], r["tensor_parallel"]) == ("bloom-176b", "a100-80gb", "8")]


def medians(rows, column: str) -> tuple[list[int], list[float]]:
    by = {}
    for r in rows:
        by.setdefault(int(r["prompt_size"]) * int(r["batch_size"]), []).append(float(r[column]) / 1000)
    xs = sorted(by)
    return xs, [statistics.median(by[x]) for x in xs]


def build(shape, **changes):
    return COST.build("splitwise_profile", COST.get("splitwise_profile").Config(),
                      dataclasses.replace(shape, **changes))


def test_steps_are_priced_as_the_profile_rows_say(shape, rows):
    m = build(shape)
    xs, ys = medians(rows, "prompt_time")
    assert xs[0] == 128 and len(xs) > 4
    for n in (xs[2], 700, 2048, 5000):       # a profiled count and counts between them
        step = Step((BatchShape("extend", (n,), (0,)),))
        assert m.step_time(step) == pytest.approx(float(np.interp(n, xs, ys)), rel=1e-12)
    # two prompts in one step: priced at their tokens together (Splitwise's batch tokens)
    assert m.step_time(Step((BatchShape("extend", (300, 400), (0, 0)),))) == pytest.approx(
        float(np.interp(700, xs, ys)), rel=1e-12)
    tx, ty = medians(rows, "token_time")
    for b in (128, 300):
        assert m.step_time(Step((decode_shape(b, 900 * b),))) == pytest.approx(float(np.interp(b, tx, ty)), rel=1e-12)
    # below the smallest count: the line through the two smallest, as interp1d(fill_value="extrapolate")
    below = ty[0] + (ty[1] - ty[0]) * (16 - tx[0]) / (tx[1] - tx[0])
    assert m.step_time(Step((decode_shape(16, 16000),))) == pytest.approx(below, rel=1e-12)
    assert m.decode_times((16,), (16000,), 3) == pytest.approx([below] * 3, rel=1e-12)
    # the KV link: 200 GiB/s per instance pair (splitwise-sim's mixed_pool.yml), shared by the instance's 8 GPUs
    assert m.kv_transfer_time(200 * 2**30, True, lanes=8) == pytest.approx(1.0)


def test_what_was_not_profiled_is_refused(shape):
    with pytest.raises(UserError, match=re.escape("prices model=bloom176b_mla on hardware=a100_80g|h100_sxm only")):
        build(shape, model=dataclasses.replace(shape.model, name="opt13b_mla"))
    with pytest.raises(UserError, match="not model=bloom176b_mla on hardware=b200"):
        build(shape, hardware=dataclasses.replace(shape.hardware, name="b200"))
    with pytest.raises(UserError, match=r"no rows for bloom-176b on a100-80gb at TP 4; profiled: .*a100-80gb/TP8"):
        build(shape, size=4)
    with pytest.raises(UserError, match="no Splitwise profile there"):
        COST.build("splitwise_profile", COST.get("splitwise_profile").Config(path="data/splitwise/absent.csv"), shape)
