"""One failure rule for every load driver (framework/load/sessions.py): a turn that fails ends its session, and each
later turn is recorded as failed and not sent. Here on the in-process driver with a real engine (a prompt larger
than the whole KV pool can never be admitted) and on the HTTP client against a real worker on loopback (which
refuses the same prompt); the simulator's driver is checked in tests/sim/test_sim.py."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestServer

from framework.contracts.parallel import ParallelConfig, Parallelism
from framework.contracts.workload import Session, Turn, WorkloadConfig
from framework.core.registry import MOE
from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.instance.client import local_client
from framework.load.http_client import LoadClient
from framework.load.inprocess import play
from framework.model.config import ModelConfig
from framework.serving.worker import create_worker_app


def engine() -> Engine:
    return Engine(ModelConfig(), EngineConfig(kv_budget_mb=0.5), Parallelism(ParallelConfig(), Group()),
                  MOE.get("reference").Config(), 0)


def workload(capacity: int) -> list[Session]:
    """One session whose first prompt can never fit (3 turns), one that completes (2 turns)."""
    turns = [Turn("x" * (capacity + 10), 2), Turn(" more", 2), Turn(" again", 2)]
    return [Session("doomed", 0.0, turns), Session("fine", 0.0, [Turn("hello", 2), Turn(" there", 2)])]


def check(records) -> None:
    by = {(r.session, r.turn): r for r in records}
    assert sorted(by) == [("doomed", 0), ("doomed", 1), ("doomed", 2), ("fine", 0), ("fine", 1)]
    assert not by["doomed", 0].ok and "not sent" not in by["doomed", 0].error
    for k in (1, 2):
        assert not by["doomed", k].ok and by["doomed", k].error == "not sent: turn 0 of doomed failed"
    assert by["fine", 0].ok and by["fine", 1].ok


def test_the_inprocess_driver_records_the_turns_a_failure_leaves_unsent():
    e = engine()
    records, _ = play(e, workload(e.capacity), WorkloadConfig(), progress=False)
    check(records)


def test_the_http_client_records_the_turns_a_failure_leaves_unsent():
    client = local_client(engine())

    async def go():
        server = TestServer(create_worker_app(client), host="127.0.0.1")
        await server.start_server()
        try:
            capacity = client.local_engine.capacity
            load = LoadClient(f"http://127.0.0.1:{server.port}", WorkloadConfig(), retries=0)
            return (await load.play_async(workload(capacity)))[0]
        finally:
            await server.close()
    try:
        check(asyncio.run(go()))
    finally:
        client.close()


def test_the_simulator_records_the_turns_a_failure_leaves_unsent():
    from framework.config import compose
    from framework.runs.sim import build
    cfg = compose(["mode=sim", "logger.mode=disabled", "cluster.instances=1", "engine.kv_budget_mb=0.5"])
    probe = build(cfg, [])
    capacity = next(iter(probe.instances.values())).memory.kv_tokens
    records, _ = build(cfg, workload(capacity)).run()
    check(records)
