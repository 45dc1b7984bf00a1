"""sim.cost.between=grid: the calibrated profile's measured points price the steps they measured, bilinear between
them, and past the grid the fit's growth from its edge."""
import json

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step
from framework.core.registry import COST
from framework.runs.sim import cost_instance
from framework.core.paths import REPO_ROOT
from plugins.cost.calibrated import DEFAULT_PATH, decode_time, prefill_time


def _cost(between: str):
    cfg = COST.get("calibrated").Config(between=between)
    return COST.build("calibrated", cfg, cost_instance(compose(["logger.mode=disabled"])))


def _profile():
    return json.loads((REPO_ROOT / DEFAULT_PATH).read_text())["profiles"]["singlex1/reference"]


def _prefill(cost, n: int, p: int) -> float:
    return cost.step_time(Step(batches=(BatchShape("extend", (n,), (p,)),)))


def _decode(cost, b: int, c: int) -> float:
    return cost.step_time(Step(batches=(BatchShape("decode", (1,) * b, (c,) * b),)))


def test_grid_prices_the_measured_points_and_between_them():
    pre, dec = _profile()["prefill"], _profile()["decode"]
    grid = _cost("grid")
    for i, n in enumerate(pre["new"]):
        for j, p in enumerate(pre["prefix"]):
            assert _prefill(grid, n, p) == pytest.approx(pre["seconds"][i][j])
    for i, b in enumerate(dec["batch"]):
        for j, c in enumerate(dec["context"]):
            assert _decode(grid, b, c) == pytest.approx(dec["seconds"][i][j])
    # halfway between two measured new-token counts, on a measured prefix: their mean
    n0, n1, p = pre["new"][-2], pre["new"][-1], pre["prefix"][1]
    mid = (pre["seconds"][-2][1] + pre["seconds"][-1][1]) / 2
    assert _prefill(grid, (n0 + n1) // 2, p) == pytest.approx(mid, rel=1e-3)


def test_grid_past_its_edge_grows_as_the_fit_and_fit_is_the_default():
    dec = _profile()["decode"]
    grid, fit = _cost("grid"), _cost("fit")
    b, c = dec["batch"][-1], dec["context"][-1]
    edge = dec["seconds"][-1][-1]
    assert _decode(grid, 2 * b, c) == pytest.approx(edge * _decode(fit, 2 * b, c) / _decode(fit, b, c))
    assert _decode(fit, 3, 100) == pytest.approx(decode_time(fit.decode.coef, 3, 100))
    assert _prefill(fit, 100, 50) == pytest.approx(prefill_time(fit.prefill.coef, 100, 50))
    assert COST.get("calibrated").Config().between == "fit"


def test_an_unknown_between_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"between='table'.*\('fit', 'grid'\)"):
        _cost("table")


def test_past_an_edge_where_the_fit_is_zero_the_price_still_grows():
    from plugins.cost.calibrated import Grid
    g = Grid([1, 2], [0, 1], [[1.0, 2.0], [3.0, 4.0]], lambda n, p: n * p)   # 0 on the p = 0 edge
    assert g(4, 0) == 3.0 and g(4, 2) == pytest.approx(4.0 * 8 / 2)
    assert g(8, 0) == 3.0  # the fit says nothing grows along p = 0
    g0 = Grid([1, 2], [0, 1], [[1.0, 2.0], [3.0, 4.0]], lambda n, p: 0.0 if n <= 2 else n)
    assert g0(4, 0) == 3.0 + 4


def test_a_grid_with_one_point_on_an_axis_is_refused_clearly():
    from plugins.cost.calibrated import Grid
    with pytest.raises(ValueError, match="at least 2 increasing points on the grid's second axis"):
        Grid([1, 2], [0], [[1.0], [2.0]], lambda n, p: 1.0)


def _extend(cost, news: tuple, prefixes: tuple) -> float:
    return cost.step_time(Step(batches=(BatchShape("extend", news, prefixes),)))


@pytest.mark.parametrize("between", ["fit", "grid"])
def test_per_request_extend_prices_each_request_s_attention_on_its_own(between):
    """sim.cost.extend=per_request: four requests of 128 new tokens attend 4 x 128^2, not 512^2 (the engine attends
    request by request); one request, and the default (batch), are priced as before."""
    cfg = COST.get("calibrated").Config
    inst = cost_instance(compose(["logger.mode=disabled"]))
    lumped = COST.build("calibrated", cfg(between=between), inst)
    split = COST.build("calibrated", cfg(between=between, extend="per_request"), inst)
    assert cfg().extend == "batch"
    c = lumped.prefill.coef
    assert c[3] > 0                                         # the profile's n^2 term: what per_request changes
    news, prefixes = (128, 128, 64, 192), (0, 256, 0, 1024)
    new, attended = sum(news), sum(n * p for n, p in zip(news, prefixes))
    whole = prefill_time(c, new, attended / new)
    expected = _extend(lumped, news, prefixes) * (whole - c[3] * (new * new - sum(n * n for n in news))) / whole
    assert _extend(split, news, prefixes) == pytest.approx(expected)
    assert _extend(split, news, prefixes) < _extend(lumped, news, prefixes)
    if between == "fit":                                    # the fit's own form, summed per request
        assert _extend(split, news, prefixes) == pytest.approx(
            c[0] + c[1] * new + c[2] * attended + c[3] * sum(n * n for n in news))
    assert _extend(split, (300,), (100,)) == _extend(lumped, (300,), (100,))
    with pytest.raises(ValueError, match=r"extend='each'.*\('batch', 'per_request'\)"):
        COST.build("calibrated", cfg(extend="each"), inst)
