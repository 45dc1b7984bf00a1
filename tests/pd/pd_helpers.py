"""Helpers for the prefill/decode tests: instance specs by role, a paired request's two halves, pool counters."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from contextlib import aclosing

from framework.config import compose
from framework.core.ports import free_ports
from framework.engine.disagg import Pairing
from framework.instance.handle import generate
from framework.instance.rank_loop import InstanceSpec

HOST = "127.0.0.1"


def base_cfg(*overrides: str):
    return compose(["logger.mode=disabled", "engine.kv_budget_mb=1", "engine.device=cpu", *overrides])


def spec(cfg, role: str = "mixed", **engine) -> InstanceSpec:
    """The config's instance with `role` and engine fields (a prefill one: a free bootstrap port unless given)."""
    if role == "prefill":
        engine.setdefault("disaggregation_bootstrap_port", free_ports(HOST, 1)[0])
    eng = dataclasses.replace(cfg.engine, role=role, **engine)
    return InstanceSpec(cfg.model, eng, cfg.parallel, cfg.moe, cfg.seed)


def pairing_for(prefill_spec: InstanceSpec) -> Pairing:
    """A fresh room at the prefill instance's bootstrap address (as a P/D router draws one per request)."""
    return Pairing(random.getrandbits(63), HOST, prefill_spec.engine.disaggregation_bootstrap_port)


async def collect(client, prompt, params, pairing=None):
    """(token ids, last output) of one request; raises what the stream raised."""
    tokens, last = [], None
    async with aclosing(generate(client, prompt, params, pairing=pairing)) as outputs:
        async for out in outputs:
            tokens += out.token_ids
            last = out
    return tokens, last


def counters(client) -> dict:
    """What a rank holds for requests, beside its radix cache: slots (less the cache's), rows, queue lengths."""
    engine = client.local_engine
    s = engine.scheduler
    return {"slots_in_use": s.pool.used() - s.cache.total_size(), "rows_free": s.req_to_token.available(),
            "locked": s.cache.protected_size(), **s.disagg.stats()} if s.disagg else \
        {"slots_in_use": s.pool.used() - s.cache.total_size(), "rows_free": s.req_to_token.available()}


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


async def wait_async(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.02)
