"""A request that names its DP group (SGLang's `data_parallel_rank`; a router addressing DP groups itself), over real
loopback HTTP to a worker in front of a real one-rank instance: the worker hands the pin to the instance's DP
controller, which serves it there or refuses a group the instance does not have."""
from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from framework.engine.engine import Engine
from framework.engine.config import EngineConfig
from framework.contracts.parallel import Parallelism, ParallelConfig
from framework.dist import Group
from framework.instance.client import local_client
from framework.model.config import ModelConfig
from framework.serving.worker import DP_RANK_HEADER, create_worker_app
from plugins.moe.reference import ReferenceConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def worker():
    engine = Engine(ModelConfig(), EngineConfig(kv_budget_mb=1.0, device="cpu"), Parallelism(ParallelConfig(), Group()),
                    ReferenceConfig(), seed=0)
    client = local_client(engine)
    server = TestServer(create_worker_app(client, model_name="tiny"), host="127.0.0.1")
    await server.start_server()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        yield http
    await server.close()
    client.close()


def body(**extra) -> dict:
    return {"text": "hello", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, **extra}


async def test_the_worker_honours_a_dp_rank_and_refuses_one_the_instance_lacks(worker):
    async with worker.post("/generate", json=body()) as r:
        unpinned = (r.status, (await r.json())["text"])
    async with worker.post("/generate", json=body(data_parallel_rank=0)) as r:
        assert (r.status, (await r.json())["text"]) == unpinned
    async with worker.post("/generate", json=body(data_parallel_rank=1)) as r:
        assert r.status == 400 and "dp_rank=1 is outside this instance's ranks 0..0" in await r.text()
    async with worker.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                           headers={DP_RANK_HEADER: "3"}) as r:
        assert r.status == 400 and "dp_rank=3" in await r.text()
    async with worker.post("/generate", json=body(), headers={DP_RANK_HEADER: "first"}) as r:
        assert r.status == 400 and DP_RANK_HEADER in await r.text()
    async with worker.post("/generate", json=body(data_parallel_rank=-1)) as r:
        assert r.status == 400
