"""Where servelab's Scheduler departs from SGLang v0.4.1 on purpose (docs/fidelity.md): each case runs where SGLang
would stall or stop, and nothing is lost."""
from __future__ import annotations

import pytest
import torch

from framework.engine.config import EngineConfig
from framework.engine.kv_pool import KVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler


def run(sched: Scheduler, reqs: list[tuple[int, Req]], max_steps: int = 2000) -> int:
    """Add each request at its step, step until done. Returns the steps taken."""
    pending, step = sorted(reqs, key=lambda r: r[0]), 0
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        batch = sched.next_batch()
        if batch is not None:
            sched.process(batch, [7] * sum(batch.sample), float(step))
        step += 1
        assert step < max_steps, "the scheduler stalled"
    return step


def scheduler(capacity: int, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(**cfg), KVPool(1, 1, capacity, torch.float32), eos_id=-1, decode_tail=lambda i: "")


@pytest.mark.parametrize("alternate", [False, True])
@pytest.mark.parametrize("decode_first", [2, 4])
def test_alternation_can_run_a_prefill_out_of_memory(alternate, decode_first):
    """A 84-token prompt in 4-token chunks joins a request that decoded `decode_first` steps in a 100-slot pool.
    SGLang's order (chunks back to back) fits. With alternate_extend_decode the decodes in between eat the chunks'
    room: the last decode is retracted (decode_first=2; SGLang asserts a free slot for its last request) or the
    chunk's allocation finds too few slots (decode_first=4; SGLang exits there) and servelab retracts the decode.
    The retracted request later re-enters an idle engine reserving only the tokens it has left (SGLang reserves its
    whole max_new_tokens again, which no longer fits: batch_is_full would then hold it forever)."""
    sched = scheduler(100, chunked_prefill_tokens=4, init_new_token_ratio=0.0, alternate_extend_decode=alternate)
    decoding = Req([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=93, ignore_eos=True))
    prefill = Req([200 + i % 50 for i in range(84)], SamplingParams(max_new_tokens=1, ignore_eos=True))
    run(sched, [(0, decoding), (decode_first, prefill)])
    assert len(decoding.output_ids) == 93 and len(prefill.output_ids) == 1
    stats = sched.stats
    assert stats["retractions"] == int(alternate) and decoding.retractions == int(alternate)
    assert stats["prefill_retractions"] == int(alternate and decode_first == 4)
    assert sched.pool.available() + sched.cache.evictable_size() == 100     # nothing leaked


def test_prefill_out_of_memory_with_nothing_to_retract_says_so():
    """A chunk that finds no slots and nothing to retract (admission checked the whole prompt, so only a leak gets
    here): a clear error, not a hang (SGLang exits)."""
    sched = scheduler(20, chunked_prefill_tokens=4)
    sched.add(Req(list(range(12)), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    sched.process(sched.next_batch(), [], 0.0)        # the first chunk
    sched.pool.alloc(sched.pool.available() - 2)      # the leak
    with pytest.raises(RuntimeError, match="KV pool exhausted: a prefill needs 4 slots, 2 are free"):
        sched.next_batch()


def test_requests_sglang_would_clip_are_refused():
    """SGLang clips max_new_tokens to max_req_len - prompt - 1 (max_req_len = min(context, capacity) - 1);
    servelab refuses a request beyond that instead of cutting it short."""
    sched = Scheduler(EngineConfig(), KVPool(1, 1, 1000, torch.float32), -1, lambda i: "", context_len=64)
    sched.add(Req([1] * 30, SamplingParams(max_new_tokens=32)))               # 62 = 64 - 2
    with pytest.raises(ValueError, match=r"= 63 tokens, more than a request may hold on this rank: 62 \(its context "
                                         r"length of 64 tokens"):
        sched.add(Req([1] * 31, SamplingParams(max_new_tokens=32)))


def test_the_engine_part_of_each_ttft_is_counted_from_arrival_to_first_token():
    """engine_ttft_s sums, over the requests that got their first token, the seconds from their arrival at the
    engine to it (the process() clock: here the step number): a request added at step 3 that arrived at 1.5 and
    prefilled at once counts 3 - 1.5 (results.json's engine_ttft_ms_mean, their mean: tests/sim/test_sim.py)."""
    sched = scheduler(4096)
    reqs = [(0, Req(list(range(1, 9)), SamplingParams(max_new_tokens=3), arrival_time=-0.5)),
            (3, Req(list(range(1, 9)), SamplingParams(max_new_tokens=3), arrival_time=1.5))]
    run(sched, reqs)
    firsts = [r.first_token_time - r.arrival_time for _, r in reqs]
    assert sched.stats["first_tokens"] == 2 and sched.stats["engine_ttft_s"] == pytest.approx(sum(firsts))
    assert firsts == [0.5, 1.5]
