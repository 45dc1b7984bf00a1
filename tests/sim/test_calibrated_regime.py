"""sim.cost.prefix_regime=absorbed: an extend batch is priced in the form the engine runs it in (the MLA attention's
normal form with no cached prefix, its absorbed form with any: framework/model/attention.py), from the profile's p = 0
column or from its cached columns alone, each with its own fit; smooth (the default) reads one grid across both."""
import json

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.runs.sim import cost_instance
from plugins.cost.calibrated import DEFAULT_PATH, Fit, PREFILL_TERMS, prefill_time


def _cost(regime: str, between: str = "grid", path: str = DEFAULT_PATH):
    cfg = COST.get("calibrated").Config(between=between, prefix_regime=regime, path=path)
    return COST.build("calibrated", cfg, cost_instance(compose(["logger.mode=disabled"])))


def _pre():
    return json.loads((REPO_ROOT / DEFAULT_PATH).read_text())["profiles"]["singlex1/reference"]["prefill"]


def _extend(cost, news: tuple, prefixes: tuple) -> float:
    return cost.step_time(Step(batches=(BatchShape("extend", news, prefixes),)))


def test_both_regimes_price_the_measured_points():
    pre, cost = _pre(), _cost("absorbed")
    for i, n in enumerate(pre["new"]):
        for j, p in enumerate(pre["prefix"]):
            assert _extend(cost, (n,), (p,)) == pytest.approx(pre["seconds"][i][j])


def test_a_small_cached_prefix_is_priced_in_the_absorbed_form():
    pre, absorbed, smooth = _pre(), _cost("absorbed"), _cost("smooth")
    i, n = len(pre["new"]) - 1, pre["new"][-1]
    first = pre["prefix"][1]  # the smallest cached column: below it, its growth by the cached columns' own fit
    cached = Fit(PREFILL_TERMS, pre["new"], pre["prefix"][1:], [row[1:] for row in pre["seconds"]])
    want = pre["seconds"][i][1] * prefill_time(cached.coef, n, 8) / prefill_time(cached.coef, n, first)
    assert _extend(absorbed, (n,), (8,)) == pytest.approx(want)
    # smooth: the p = 0 column plus 8/256 of the way to the first cached one
    w = 8 / first
    assert _extend(smooth, (n,), (8,)) == pytest.approx((1 - w) * pre["seconds"][i][0] + w * pre["seconds"][i][1])
    assert _extend(absorbed, (n,), (8,)) != pytest.approx(_extend(smooth, (n,), (8,)))


def test_a_batch_is_absorbed_when_any_request_has_a_prefix_as_the_engine_decides():
    # the engine: AttentionMetadata.absorbed = any(batch.prefix_lens) (framework/model/attention.py)
    absorbed = _cost("absorbed")
    # extend=batch: one request of the batch's tokens at their token-weighted mean prefix, in the batch's form
    assert _extend(absorbed, (256, 256), (0, 0)) == pytest.approx(_extend(absorbed, (512,), (0,)))
    mixed = _extend(absorbed, (256, 256), (0, 32))  # one request with a prefix: the whole batch absorbed, mean 16
    assert mixed == pytest.approx(_extend(absorbed, (512,), (16,)))
    smooth = _cost("smooth")
    assert _extend(smooth, (256, 256), (0, 32)) == pytest.approx(_extend(smooth, (512,), (16,)))


def test_the_fit_reading_keeps_the_regimes_apart_too():
    pre, cost = _pre(), _cost("absorbed", between="fit")
    fresh = Fit(PREFILL_TERMS, pre["new"], [0], [row[:1] for row in pre["seconds"]])
    cached = Fit(PREFILL_TERMS, pre["new"], pre["prefix"][1:], [row[1:] for row in pre["seconds"]])
    assert _extend(cost, (300,), (0,)) == pytest.approx(prefill_time(fresh.coef, 300, 0))
    assert _extend(cost, (300,), (40,)) == pytest.approx(prefill_time(cached.coef, 300, 40))


def test_bad_regimes_and_profiles_are_refused_with_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"prefix_regime='sharp' is not one of \('smooth', 'absorbed'\)"):
        _cost("sharp")
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    pre = data["profiles"]["singlex1/reference"]["prefill"]
    for key in ("seconds", "seconds_median"):
        pre[key] = [row[:2] for row in pre[key]]
    pre["prefix"] = pre["prefix"][:2]  # one cached column: no fit of its own
    path = tmp_path / "one_cached_column.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"at least two cached-prefix columns.*prefixes \[0, 256\].*prefix_regime=smooth"):
        _cost("absorbed", path=str(path))
    assert _extend(_cost("smooth", path=str(path)), (8,), (0,)) > 0  # smooth reads it as before
