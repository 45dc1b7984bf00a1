"""engine.scheduler=vllm_v0_1_7: vLLM's scheduler as DistServe's artifact ran its baseline (framework/engine/
vllm_policy.py). Each rule on a small hand-made batch, block size 4; each test fails if its rule is off."""
from __future__ import annotations

import random

import pytest
import torch

from framework.engine.config import EngineConfig
from framework.engine.kv_pool import CountingKVPool, KVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler


def vllm(capacity: int, counting: bool = False, **cfg) -> Scheduler:
    cfg = EngineConfig(**{"scheduler": "vllm_v0_1_7", "radix_cache": False, "vllm_block_size": 4,
                          "vllm_watermark": 0.0, "max_prefill_tokens": 64, "max_running_requests": 8, **cfg})
    cfg.validate()
    pool = CountingKVPool(capacity) if counting else KVPool(1, 1, capacity, torch.float32)
    sched = Scheduler(cfg, pool, eos_id=-1, decode_tail=lambda i: "")
    sched.step_log = []
    return sched


def req(prompt: int, max_new: int, arrival: float, name: str) -> Req:
    return Req([1 + i % 50 for i in range(prompt)], SamplingParams(max_new_tokens=max_new, ignore_eos=True),
               rid=name, arrival_time=arrival)


def step(sched: Scheduler, now: float = 0.0):
    batch = sched.next_batch()
    if batch is not None:
        sched.process(batch, [7] * sum(batch.sample), now)
    return sched.step_log[-1] if batch is not None else None


def test_a_step_is_all_prefill_whole_prompts_before_any_decode():
    """A request arriving while another decodes is prefilled alone and whole (no chunk, no decode in that step),
    although engine.chunked_prefill_tokens is 4: vLLM has no chunked prefill and runs prefills first."""
    sched = vllm(256, chunked_prefill_tokens=4)
    sched.add(req(5, 20, 0.0, "a"))
    assert step(sched).mode == "extend"
    assert step(sched).mode == "decode"
    sched.add(req(30, 5, 1.0, "b"))
    rec = step(sched)
    assert (rec.mode, rec.rids, rec.extend_lens) == ("extend", ("b",), (30,))
    rec = step(sched)
    assert (rec.mode, rec.rids) == ("decode", ("a", "b"))


def test_admission_is_fcfs_and_stops_at_the_first_request_that_does_not_fit():
    """max_num_batched_tokens 16: a (10) is admitted, b (10) would pass 16 and stops the batch; c (4) would fit but
    waits behind b (no skipping); the next step takes b and c."""
    sched = vllm(256, max_prefill_tokens=16)
    for r in (req(10, 2, 0, "a"), req(10, 2, 1, "b"), req(4, 2, 2, "c")):
        sched.add(r)
    assert step(sched).rids == ("a",)
    rec = step(sched)
    assert (rec.mode, rec.rids) == ("extend", ("b", "c"))


def test_admission_stops_at_max_num_seqs():
    """max_num_seqs (engine.max_running_requests) 2: the third request waits until one finishes."""
    sched = vllm(256, max_running_requests=2)
    for i, n in enumerate((1, 3, 3)):
        sched.add(req(4, n, i, "abc"[i]))
    assert step(sched).rids == ("a", "b")      # a finishes at its prefill (max_new 1)
    assert step(sched).rids == ("c",)          # its row is free again: c admitted before b decodes


@pytest.mark.parametrize("watermark, admitted", [(0.02, True), (0.03, False)])
def test_the_watermark_keeps_blocks_free_at_admission(watermark, admitted):
    """100 blocks; a holds 2, b needs 96: admitted iff the 2 left are at least the watermark, int(w x 100) blocks
    (`can_allocate`)."""
    sched = vllm(400, vllm_watermark=watermark, max_prefill_tokens=1024)
    sched.add(req(5, 50, 0, "a"))
    step(sched)
    sched.add(req(4 * 96, 2, 1, "b"))
    assert (step(sched).mode == "extend") == admitted


def test_decode_takes_a_block_only_when_the_last_is_full_and_needs_one_free_block_per_request():
    """8 blocks of 4; a, b, c: 5-token prompts (2 blocks each, 2 left). Tokens 6-8 fit the second blocks. The 9th:
    a and b take the last 2 blocks, c finds none and is preempted (no later arrival left: the request itself). With
    c's 2 blocks back, tokens 10-13 of a and b take them. Then a, whose 4th block still has room, finds no free block
    and b (the latest arrival) is preempted: `can_append_slot` asks for a free block whatever the request needs."""
    sched = vllm(32)
    for i in range(3):
        sched.add(req(5, 10, i, "abc"[i]))
    step(sched)
    for _ in range(3):
        assert step(sched).retracted == ()
    assert sched.vllm.free_blocks(sched.running) == 2
    rec = step(sched)
    assert (rec.rids, rec.retracted) == (("a", "b"), ("c",))
    for _ in range(4):
        assert step(sched).retracted == ()
    assert sched.vllm.free_blocks(sched.running) == 0 and sched.running[0].kv_len % 4 != 0
    rec = step(sched)
    assert (rec.rids, rec.retracted) == (("a",), ("b",))
    assert [r.rid for r in sched.waiting] == ["b", "c"]    # each victim to the front: the earlier arrival first


def test_decode_runs_in_arrival_order_and_preempts_the_latest_arrival():
    """b is queued before a but arrived after it (vLLM's FCFS sorts the running requests by arrival_time): the
    decode batch runs a first, and when blocks run out b, the later arrival, is preempted, not a, the last one
    admitted. Its 9th token finds no free block (a and b took the last two with their 8th)."""
    sched = vllm(24)                            # 6 blocks
    sched.add(req(7, 12, 1.0, "b"))
    sched.add(req(7, 12, 0.0, "a"))
    assert step(sched).rids == ("b", "a")       # the waiting queue is not sorted: admitted as queued
    log = [step(sched) for _ in range(6)]
    assert log[0].rids == ("a", "b")
    preempted = [r for rec in log for r in rec.retracted]
    assert preempted and set(preempted) == {"b"}    # (watermark 0: b is re-admitted into a's room, and goes again)


def test_a_preempted_request_is_recomputed_over_prompt_and_outputs():
    """Preemption by recomputation: the victim's blocks are freed and its next prefill runs its prompt and every
    output so far; nothing leaks."""
    sched = vllm(32)
    for i in range(3):
        sched.add(req(5, 10, i, "abc"[i]))
    while sched.has_work():
        step(sched)
    resumed = {rid: n for rec in sched.step_log[1:] if rec.mode == "extend"
               for rid, n in zip(rec.rids, rec.extend_lens)}
    assert resumed == {"b": 5 + 9, "c": 5 + 4}
    assert sched.stats["retractions"] == 2 and sched.pool.available() == 32


def test_requests_vllm_would_drop_or_never_run_are_refused():
    sched = vllm(64, max_prefill_tokens=32)
    with pytest.raises(ValueError, match="more than vLLM's max_num_batched_tokens"):
        sched.add(req(20, 13, 0, "x"))
    sched = vllm(64, vllm_watermark=0.25)       # 16 blocks, 4 of them the watermark
    with pytest.raises(ValueError, match="need 13 blocks of 4; the pool has 16, less the watermark's 4"):
        sched.add(req(40, 10, 0, "y"))


def test_settings_vllm_does_not_have_are_refused():
    with pytest.raises(ValueError, match="has no prefix caching: set engine.radix_cache=false"):
        EngineConfig(scheduler="vllm_v0_1_7").validate()
    with pytest.raises(ValueError, match="engine.scheduler='vllm' is not one of sglang, vllm_v0_1_7"):
        EngineConfig(scheduler="vllm", radix_cache=False).validate()


@pytest.mark.parametrize("seed", range(4))
def test_runs_of_decode_steps_match_stepping_one_by_one(seed):
    """The simulator's fast path (decode_steps_ahead + advance_decode) makes exactly the decisions of stepping one
    step at a time, preemptions included: the same step log and outputs on a random workload that runs out of
    blocks."""
    rng = random.Random(seed)
    work = sorted((rng.randrange(0, 60), rng.randrange(3, 30), rng.randrange(1, 40)) for _ in range(12))

    def play(fast: bool) -> tuple[list, list, int]:
        sched, pending, now = vllm(160, counting=True, max_running_requests=6, max_prefill_tokens=128), list(work), 0
        reqs, runs = [], 0
        while pending or sched.has_work():
            while pending and pending[0][0] <= now:
                at, p, n = pending.pop(0)
                reqs.append(req(p, n, at + len(reqs) * 1e-3, f"r{len(reqs)}"))
                sched.add(reqs[-1])
            k = sched.decode_steps_ahead() if fast else 0
            if pending:
                k = min(k, pending[0][0] - now)
            if k > 1:
                sched.advance_decode(k, lambda r, n: [7] * n, float(now + k))
                now, runs = now + k, runs + 1
            else:
                step(sched, float(now))
                now += 1
            assert now < 5000
        return sched.step_log, [(r.rid, len(r.output_ids), r.retractions) for r in reqs], runs

    slow, fast = play(False), play(True)
    assert fast[:2] == slow[:2] and any(rec.retracted for rec in slow[0]) and fast[2] > 0
