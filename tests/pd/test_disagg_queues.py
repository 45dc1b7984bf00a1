"""A rank's prefill/decode queues (framework/engine/disagg.py) over a real scheduler, pool and radix cache: what a
decode rank pre-allocates, what it frees and when, what a prefill rank holds; the pool counters return to their start."""
from __future__ import annotations

import torch

from framework.contracts.batch import ForwardMode
from framework.engine.config import EngineConfig
from framework.engine.disagg import Pairing
from framework.engine.kv_pool import KVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler

PAIRING = Pairing(7, "127.0.0.1", 1)


def scheduler(role: str, capacity: int = 200, **cfg) -> Scheduler:
    pool = KVPool(2, 4, capacity, torch.float32)
    return Scheduler(EngineConfig(role=role, max_running_requests=8, **cfg), pool, eos_id=0,
                     decode_tail=lambda ids: "", context_len=1000)


def paired(prompt: list[int], max_new: int = 4, rid: str | None = None) -> Req:
    return Req(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), pairing=PAIRING,
               **({"rid": rid} if rid else {}))


def held(s: Scheduler) -> tuple[int, int]:
    """(slots requests hold beyond the cache, rows in use)."""
    return s.pool.used() - s.cache.total_size(), s.max_running - s.req_to_token.available()


def test_decode_preallocates_receives_then_decodes_and_frees():
    s = scheduler("decode")
    req = paired(list(range(1, 11)))
    s.add_paired(req)
    assert s.next_batch() is None                        # nothing to run until the KV lands
    (dest,) = s.disagg.take_allocated()
    assert dest.first == 0 and len(dest.slots) == 10 and held(s) == (10, 1)
    assert s.disagg.arrived(req.rid, 42, cached_tokens=3, now=1.0) is req
    assert req.output_ids == [42] and req.kv_len == 10 and req.cached_tokens == 3
    batch = s.next_batch()
    assert batch.mode is ForwardMode.DECODE and batch.input_ids.tolist() == [42] and batch.positions.tolist() == [10]
    for _ in range(3):
        s.process(batch, [5], 2.0)
        batch = s.next_batch()
    assert batch is None and req.finished and req.output_ids == [42, 5, 5, 5] and held(s) == (0, 0)   # finished: its KV went to the radix cache


def test_decode_abort_keeps_the_slots_until_the_prefill_side_answers():
    s = scheduler("decode")
    waiting, receiving = paired([1, 2, 3], rid="w"), paired([4, 5, 6, 7], rid="r")
    s.add_paired(receiving)
    s.next_batch()
    s.add_paired(waiting)                                 # not pre-allocated before the next step
    assert s.abort("w") is None and not s.disagg.waiting_slots
    s.abort("r")
    assert held(s) == (4, 1)                              # the prefill side may still be writing them
    assert s.disagg.failed("r") is None and held(s) == (0, 0)      # it answered: freed; its client is gone


def test_decode_waits_for_slots_and_reserves_each_requests_next_tokens():
    s = scheduler("decode", capacity=30)
    first, second = paired(list(range(1, 11)), max_new=8), paired(list(range(11, 21)), max_new=8)
    s.add_paired(first)
    s.add_paired(second)
    s.next_batch()
    assert list(s.disagg.receiving) == [first.rid]        # 10 + 8 reserved of 30: the second (10 + 8) waits
    s.disagg.failed(first.rid)
    s.next_batch()
    assert list(s.disagg.receiving) == [second.rid]


def test_decode_prefix_reuse_receives_only_what_its_cache_lacks():
    s = scheduler("decode", disaggregation_decode_prefix_reuse=True)
    one = paired(list(range(1, 21)), max_new=1)
    s.add_paired(one)
    s.next_batch()
    s.disagg.take_allocated()
    s.disagg.arrived(one.rid, 9, 0, 1.0)                  # max_new_tokens 1: finished at once, cached
    two = paired(list(range(1, 16)) + [99, 98])
    s.add_paired(two)
    s.next_batch()
    (dest,) = s.disagg.take_allocated()
    assert dest.first == 15 and len(dest.slots) == 2      # the shared 15 tokens come from its own cache
    s.disagg.failed(two.rid)
    assert held(s) == (0, 0) and s.cache.protected_size() == 0


def test_prefill_stops_at_the_first_token_and_holds_the_kv_until_sent():
    s = scheduler("prefill")
    req = paired(list(range(1, 9)), max_new=50)
    s.add_paired(req)
    assert req.params.max_new_tokens == 1
    batch = s.next_batch()
    assert s.process(batch, [3], 1.0) == [req] and req.finished
    assert s.disagg.sending == {req.rid: req} and held(s) == (8, 1)
    assert s.disagg.kv_of(req.rid, 2).tolist() == s.req_to_token.slots(req.req_pool_idx, 8, 2).tolist()
    assert s.abort(req.rid) is None and held(s) == (8, 1)  # the connector releases a held request
    assert s.disagg.sent(req.rid) is req and held(s) == (0, 0) and s.cache.total_size() == 8
