"""router.dp_aware=true (sgl-router's --dp-aware): the policy chooses a (worker, DP group). Oracle: real radix caches,
one per DP group of each worker, whose events reach the router core as batches stamped with their
data_parallel_rank; the router's estimate for each request equals what the chosen group's own cache holds of it
(floored to whole blocks), so the policy's view is exact per group, and the group it names is the one that serves."""
from __future__ import annotations

import random

import pytest
import torch

from framework.contracts.routing import FLUSHED, LoadReport
from framework.core.registry import ROUTING
from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.events import BlockStored, KVEventBatch
from framework.routing.core import OK, RouterCore
from framework.routing.dp_aware import DPAware, dp_rank_of

B = 4
SIZES = {"http://a": 2, "http://b": 3}


def dp_router(key="precise_prefix", **cfg):
    cls = ROUTING.get(key)
    core = RouterCore(DPAware(cls(cls.Config(block_size=B, **cfg)), SIZES.get))
    for url in SIZES:
        core.add_worker(url, healthy=True)
    return core


def test_the_estimate_is_the_chosen_groups_own_cache():
    rng = random.Random(1)
    core = dp_router(pending_credit=False)          # the view: what the caches' events said, nothing credited
    caches = {}
    for url, n in SIZES.items():
        for r in range(n):
            cache = caches[url, r] = RadixCache(lambda s: None)
            cache.observer = CacheEventEmitter(
                B, lambda e, url=url, r=r: core.worker_events(url, [KVEventBatch(0.0, (e,), r)]))
    prefixes = [bytes(rng.randrange(97, 100) for _ in range(rng.randrange(4, 30))) for _ in range(8)]
    chosen, in_flight = set(), []
    for i in range(300):
        text = (rng.choice(prefixes) + bytes(rng.randrange(97, 100) for _ in range(rng.randrange(1, 12)))).decode()
        tokens = list(text.encode())
        att = core.dispatch(text)
        rank = dp_rank_of(att.decision)
        held = caches[att.worker.url, rank].match_prefix(tokens)[0].shape[0]
        assert att.decision.matched_chars == min(held // B * B, len(tokens) - 1), (i, text)
        caches[att.worker.url, rank].insert(tokens, torch.arange(len(tokens)))   # the named group served it
        chosen.add((att.worker.url, rank))
        in_flight.append(att)
        assert sum(w.in_flight for w in core.workers.values()) == len(in_flight)
        if len(in_flight) > 4:                             # a few requests stay in flight: the loads differ
            done = in_flight.pop(0)
            done.verdict, done.served = OK, True
            core.release(done)
        if i % 50 == 49:
            caches[att.worker.url, rank].evict(20)
    assert len(chosen) == 5                                # every group of every worker served


def test_loads_are_split_over_the_groups_and_a_reset_clears_every_group():
    core = dp_router()
    policy = core.policy
    heard = []
    policy.inner.on_worker_event = lambda worker, event: heard.append((worker, event))
    core.load_report("http://b", LoadReport(7, 2, 100))
    assert heard == [("http://b@0", (3, 1, 34)), ("http://b@1", (2, 1, 33)), ("http://b@2", (2, 0, 33))]
    del policy.inner.on_worker_event
    stored = BlockStored((11, 12), None, tuple(range(8)), B)
    core.worker_events("http://b", [KVEventBatch(0.0, (stored,), 2)])
    assert policy.inner.state_sizes() and core.dispatch(bytes(range(8)).decode() + "xy").decision.memo.rank == 2
    core.reset_worker("http://b", FLUSHED)
    assert dp_rank_of(core.dispatch(bytes(range(8)).decode() + "xy").decision) in (0, 1)   # no hit: the least loaded
    with pytest.raises(ValueError, match="DP rank 3; it has ranks 0..2"):
        core.worker_events("http://b", [KVEventBatch(0.0, (stored,), 3)])
    core.remove_worker("http://b")
    assert policy.inner.workers == ["http://a@0", "http://a@1"]


def test_a_worker_without_groups_is_refused():
    with pytest.raises(ValueError, match="dp_size >= 1"):
        RouterCore(DPAware(ROUTING.get("round_robin")(), lambda url: 0)).add_worker("http://c")
