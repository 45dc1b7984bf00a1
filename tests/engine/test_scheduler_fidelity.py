"""The engine's Scheduler decides as SGLang v0.4.1 does: scripted scenarios replayed on the real Scheduler (a KV pool
without a model: every step samples the same token) and on `sglang_v041`, a plain re-implementation of SGLang's
algorithm; every step's decision must be equal: the batch and its order, each request's cached prefix and extend
length, the retracted requests and their order, new_token_ratio after the step, and each request's cached tokens.
Each test names the SGLang functions whose behaviour it pins (docs/fidelity.md has the table)."""
from __future__ import annotations

import random

import pytest
import torch

from framework.engine.config import EngineConfig
from framework.engine.kv_pool import KVPool
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import Scheduler
from sglang_v041 import TOKEN, OReq, SGLangV041


def replay(arrivals, capacity: int, conservativeness: float = 1.0, max_steps: int = 5000, **cfg) -> dict:
    """arrivals: (step, rid, prompt, max_new_tokens, ignore_eos). Runs the engine's Scheduler and the oracle side by
    side and asserts that every step decides the same. Returns both logs and both sets of requests."""
    engine_cfg = EngineConfig(**cfg)
    sched = Scheduler(engine_cfg, KVPool(1, 1, capacity, torch.float32), eos_id=-1, decode_tail=lambda ids: "",
                      conservativeness=conservativeness)
    sched.step_log = []
    oracle = SGLangV041(capacity, engine_cfg.chunked_prefill_tokens, engine_cfg.max_prefill_tokens,
                        engine_cfg.max_running_requests, engine_cfg.schedule_policy, engine_cfg.radix_cache,
                        engine_cfg.init_new_token_ratio, engine_cfg.min_new_token_ratio_factor,
                        engine_cfg.new_token_ratio_decay_steps, conservativeness)
    reqs, oreqs = {}, {}
    pending = sorted(arrivals, key=lambda a: a[0])
    log, step = [], 0
    while pending or sched.has_work() or oracle.waiting or oracle.running or oracle.chunked:
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_new, ignore_eos = pending.pop(0)
            reqs[rid] = Req(list(prompt), SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos), rid=rid)
            oreqs[rid] = OReq(rid, tuple(prompt), max_new, ignore_eos)
            sched.add(reqs[rid])
            oracle.waiting.append(oreqs[rid])
        batch = sched.next_batch()
        got = None
        if batch is not None:
            r = sched.step_log[-1]
            got = (r.mode, r.rids, r.prefix_lens, r.extend_lens, r.retracted, r.new_token_ratio)
            sched.process(batch, [TOKEN] * sum(batch.sample), float(step))
        want = oracle.step()
        assert _same(got, want), f"step {step}: engine {got} != SGLang {want}"
        log.append(want)
        step += 1
        assert step < max_steps
    assert {rid: r.cached_tokens for rid, r in reqs.items()} == {rid: r.cached_tokens for rid, r in oreqs.items()}
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs.values())
    return {"log": log, "reqs": reqs, "sched": sched}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[:5] == b[:5] and abs(a[5] - b[5]) < 1e-12


def _prompt(rng: random.Random, n: int, prefix: tuple = ()) -> tuple:
    return prefix + tuple(rng.randrange(256) for _ in range(n))


def _batches(log, mode):
    return [rec for rec in log if rec is not None and rec[0] == mode]


def test_prompt_enters_the_cache_right_after_its_prefill():
    """RadixCache.cache_unfinished_req from Scheduler.process_batch_result_prefill: a request that shares a prompt
    prefix with one still decoding finds that prefix cached."""
    rng = random.Random(0)
    system = _prompt(rng, 64)
    arrivals = [(0, "a", _prompt(rng, 20, system), 30, True), (3, "b", _prompt(rng, 20, system), 5, True)]
    out = replay(arrivals, capacity=4096, chunked_prefill_tokens=512)
    assert out["reqs"]["b"].cached_tokens == 64
    assert ("extend", ("b",), (64,), (20,)) == _batches(out["log"], "extend")[1][:4]


def test_a_prefill_batch_runs_whenever_one_can_be_formed():
    """Scheduler.get_next_batch_to_run: prefill first (get_new_batch_prefill), decode (update_running_batch) only
    when no prefill batch can be formed: a burst of chunked prompts stalls the running decodes."""
    rng = random.Random(1)
    arrivals = [(0, "early", _prompt(rng, 10), 40, True)] + \
               [(2, f"p{i}", _prompt(rng, 100), 8, True) for i in range(6)]
    log = replay(arrivals, capacity=4096, chunked_prefill_tokens=64)["log"]
    modes = [rec[0] for rec in log if rec is not None]
    assert modes[:3] == ["extend", "decode", "extend"]
    assert modes[2:12] == ["extend"] * 10         # 600 prompt tokens in 64-token chunks, back to back


def test_new_token_ratio_decays_floors_and_resets_on_idle():
    """Scheduler.__init__ (init = 0.7 x schedule_conservativeness, min = 0.14 x init, decay = (init - min) / decay
    steps), Scheduler.update_running_batch (one decay per decode step) and event_loop_normal (reset when idle)."""
    rng = random.Random(2)
    arrivals = [(0, "a", _prompt(rng, 30), 40, True), (60, "b", _prompt(rng, 30), 10, True)]
    out = replay(arrivals, capacity=4096, conservativeness=0.3, new_token_ratio_decay_steps=20)
    sched = out["sched"]
    init = 0.7 * 0.3
    assert sched.init_new_token_ratio == pytest.approx(init) and sched.min_new_token_ratio == pytest.approx(0.14 * init)
    trace = [rec[5] for rec in out["log"] if rec is not None]
    assert trace[1] == pytest.approx(init - (init - 0.14 * init) / 20)
    assert min(trace) == pytest.approx(0.14 * init)        # floored after 20 decode steps
    b_prefill = next(rec for rec in out["log"] if rec is not None and rec[1] == ("b",))
    assert b_prefill[5] == pytest.approx(init)             # idle steps before b arrived reset it


def test_admission_reserves_the_new_requests_whole_max_new_tokens():
    """PrefillAdder.__init__ (running requests reserve min(max_new - out, 4096) x ratio), add_one_req (a new request
    costs extend + min(max_new, 4096); NO_TOKEN when that reaches the budget) and add_being_chunked_req (a chunk
    costs itself, the last one its max_new too)."""
    rng = random.Random(3)
    # one batch: "a" takes 40 + 500 of 1000; "b" needs 40 + 450 >= 460 left: NO_TOKEN, and batch_is_full keeps it
    # waiting until "a" finishes (reserving 500 x ratio for "a" would have let it in)
    arrivals = [(0, "a", _prompt(rng, 40), 500, False), (0, "b", _prompt(rng, 40), 450, False),
                (3, "c", _prompt(rng, 100), 20, False)]
    log = replay(arrivals, capacity=1000, chunked_prefill_tokens=64, radix_cache=False, max_steps=2000)["log"]
    assert log[0][1:4] == (("a",), (0,), (40,))
    first = {rid: n for n, rec in enumerate(log) if rec and rec[0] == "extend" for rid in reversed(rec[1])}
    last_a = max(n for n, rec in enumerate(log) if rec and "a" in rec[1])
    assert first["b"] > last_a and first["c"] > last_a
    # estimates clip max_new_tokens at 4096: 6000 - 11 - 4096 x 0.7 leaves room for 40 + 2700 (4999 x 0.7 would not)
    arrivals = [(0, "big", _prompt(rng, 10), 5000, False), (1, "other", _prompt(rng, 40), 2700, False)]
    log = replay(arrivals, capacity=6000, radix_cache=False, max_steps=6000)["log"]
    assert [rec[1] for rec in log[:2]] == [("big",), ("other",)]


@pytest.mark.parametrize("chunk", [64, 512])
def test_retract_decode_order_count_queue_and_ratio(chunk):
    """Scheduler.update_running_batch + ScheduleBatch.check_decode_mem / retract_decode: fewest outputs, then longest
    prompt, retracted first, until 20 free slots per remaining request; the batch keeps that order; the retracted
    requests go to the tail of the waiting queue; new_token_ratio = (decoded + 20 x remaining) / their max_new."""
    rng = random.Random(4)
    arrivals = [(s, f"r{s}", _prompt(rng, 20 + 7 * (s % 5)), 80, False) for s in range(0, 30, 3)]
    out = replay(arrivals, capacity=420, chunked_prefill_tokens=chunk, radix_cache=False, init_new_token_ratio=0.1)
    retractions = [rec[4] for rec in out["log"] if rec and rec[4]]
    assert retractions and out["sched"].stats["retractions"] == sum(map(len, retractions))


def test_ignore_eos_admission_simulates_the_decodes_ahead():
    """PrefillAdder.add_one_req_ignore_eos (requests ignoring EOS with the radix cache off): admission plays the
    remaining decode steps against the free slots, with SGLang's insertion order."""
    rng = random.Random(5)
    arrivals = [(s, f"r{s}", _prompt(rng, rng.randint(10, 60)), rng.randint(20, 80), True) for s in range(0, 40, 2)]
    out = replay(arrivals, capacity=700, chunked_prefill_tokens=48, radix_cache=False)
    assert max(len(rec[1]) for rec in _batches(out["log"], "decode")) < 20      # the pool capped the batch


def test_lpm_with_in_batch_prefix_caching():
    """SchedulePolicy.calc_priority: lpm sorts by cached prefix, longest first; a request with a short match sharing
    32+ tokens with an earlier waiting request goes last (one of a group fills the cache, the rest then hit it)."""
    rng = random.Random(6)
    group = _prompt(rng, 50)
    arrivals = [(0, "g0", _prompt(rng, 10, group), 4, True), (0, "g1", _prompt(rng, 10, group), 4, True),
                (0, "solo", _prompt(rng, 60), 4, True), (0, "g2", _prompt(rng, 10, group), 4, True)]
    out = replay(arrivals, capacity=4096, chunked_prefill_tokens=120)
    extends = _batches(out["log"], "extend")
    assert extends[0][1] == ("g0", "solo")                       # g1, g2 wait behind solo...
    assert extends[1][1:3] == (("g1", "g2"), (50, 50))           # ...then hit g0's prefix


def test_max_running_requests_and_batch_is_full():
    """get_new_batch_prefill: no prefill while the running batch holds max_running_requests; batch_is_full set then
    and on NO_TOKEN, reset when the running batch shrinks (update_running_batch)."""
    rng = random.Random(7)
    arrivals = [(0, f"r{i}", _prompt(rng, 12), 5 + 3 * i, True) for i in range(7)]
    out = replay(arrivals, capacity=4096, max_running_requests=3)
    assert max(len(rec[1]) for rec in _batches(out["log"], "decode")) == 3


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads(seed):
    """Everything at once: random arrivals, prompts sharing prefixes, chunking, tight pools (radix cache off, so
    that no eviction is involved) and roomy ones (radix cache on), fcfs and lpm, EOS respected or ignored."""
    rng = random.Random(100 + seed)
    radix = seed % 2 == 0
    shared = [_prompt(rng, rng.randint(20, 70)) for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(10, 25)):
        prefix = rng.choice(shared) if rng.random() < 0.6 else ()
        arrivals.append((rng.randint(0, 40), f"r{i}", _prompt(rng, rng.randint(1, 60), prefix),
                         rng.randint(1, 50), rng.random() < 0.7))
    replay(arrivals, capacity=5000 if radix else rng.randint(300, 600), radix_cache=radix,
           chunked_prefill_tokens=rng.choice([16, 48, 512]), schedule_policy=rng.choice(["lpm", "fcfs"]),
           conservativeness=rng.choice([1.0, 0.3]), init_new_token_ratio=rng.choice([0.7, 0.2]))


@pytest.mark.parametrize("idle_batch", [False, True])
def test_an_idle_batch_under_dp_attention_is_a_step(idle_batch):
    """event_loop_normal resets new_token_ratio when the batch it runs is None after prepare_dp_attn_batch: a DP rank
    that runs an IDLE batch while other ranks work keeps its ratio."""
    from framework.contracts.batch import ForwardBatch
    sched = Scheduler(EngineConfig(new_token_ratio_decay_steps=10), KVPool(1, 1, 1000, torch.float32), -1,
                      lambda ids: "")
    sched.add(Req([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    while sched.has_work():
        batch = sched.next_batch()
        if batch is not None:
            sched.process(batch, [TOKEN] * sum(batch.sample), 0.0)
    decayed = sched.new_token_ratio
    assert decayed < sched.init_new_token_ratio
    if idle_batch:
        sched.process(ForwardBatch.idle(), [], 0.0)   # the last next_batch() ran nothing here, the others ran
    sched.add(Req([4, 5, 6], SamplingParams(max_new_tokens=1, ignore_eos=True)))
    sched.next_batch()
    assert sched.new_token_ratio == (decayed if idle_batch else sched.init_new_token_ratio)
