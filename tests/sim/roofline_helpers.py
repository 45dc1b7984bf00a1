"""What the cost-term tests share: DeepSeek-V2 in fp8 on an H100 SXM, and the roofline built for it at size 8."""
from dataclasses import replace

import pytest

from framework.config import compose
from framework.contracts.cost import InstanceShape
from framework.core.registry import COST


@pytest.fixture(scope="module")
def v2():
    return replace(compose(["model=deepseek_v2"]).model, weight_dtype="fp8")


@pytest.fixture(scope="module")
def h100():
    return compose(["hardware=h100_sxm"]).hardware


def cost(model, hw, parallel="tp", **cfg):
    inst = InstanceShape(model, hw, parallel=parallel, size=8, moe="triton_fused")
    return COST.build("roofline", COST.get("roofline").Config(**cfg), inst)
