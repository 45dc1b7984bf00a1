"""`engine.disaggregation_order`: SGLang's order by default, DistServe's by name, anything else refused with the
allowed values (the orders themselves: tests/pd/test_pd_prefill_first_deadlock.py, long)."""
from __future__ import annotations

import pytest

from framework.config import compose
from framework.engine.config import DISAGGREGATION_ORDERS, EngineConfig


def test_sglangs_order_is_the_default_and_distserves_is_a_named_switch():
    assert EngineConfig().disaggregation_order == "sglang" and DISAGGREGATION_ORDERS == ("sglang", "distserve")
    assert compose(["engine.disaggregation_order=distserve"]).engine.disaggregation_order == "distserve"


def test_an_unknown_order_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="engine.disaggregation_order='pull' is not one of sglang, distserve"):
        EngineConfig(disaggregation_order="pull").validate()
