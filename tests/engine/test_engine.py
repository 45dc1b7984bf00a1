"""The engine's incremental path against the reference, and admission that never over-commits."""
import dataclasses
import json
import random

import pytest
import torch

from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.model.config import ModelConfig
from framework.model.model import build_model
from plugins.moe.reference import ReferenceConfig as MoEConfig   # moe=reference
from framework.contracts.parallel import Parallelism, ParallelConfig
from framework.runs.verify import run_case, verify_prompts

MODEL = ModelConfig()
KV_PER_TOKEN = MODEL.kv_bytes_per_token()


def make_engine(**engine_kw) -> Engine:
    return Engine(MODEL, EngineConfig(**engine_kw), Parallelism(ParallelConfig(), Group()), MoEConfig(), seed=0)


@pytest.fixture(scope="module")
def reference():
    return build_model(MODEL, 0)


TIGHT = {"kv_budget_mb": 180 * KV_PER_TOKEN / 2**20, "chunked_prefill_tokens": 16, "init_new_token_ratio": 0.05,
         "min_new_token_ratio_factor": 0.0}


@pytest.mark.parametrize("engine_kw", [
    {},                                                      # radix hits on the second round
    {"chunked_prefill_tokens": 16},                           # chunked prefill + hits (absorbed extend over a prefix)
    TIGHT,                                                   # retraction and resume
    {"radix_cache": False},
    {"radix_cache": False, "chunked_prefill_tokens": 16},     # chunks without a cache: a request's own prefix
    {"schedule_policy": "fcfs"},
    {"alternate_extend_decode": True, "chunked_prefill_tokens": 16},
])
def test_incremental_logits_match_reference(reference, engine_kw):
    engine = make_engine(**engine_kw)
    result = run_case(engine, reference, verify_prompts(0), max_new_tokens=12 if engine_kw is TIGHT else 6)
    assert result["max_abs_err"] < 1e-4, result
    if engine_kw.get("radix_cache", True):
        assert result["cached_tokens"] > 0
    if "kv_budget_mb" in engine_kw:
        assert result["retractions"] > 0


def test_admission_never_exceeds_capacity_and_drops_nothing():
    rng = random.Random(0)
    engine = make_engine(kv_budget_mb=300 * KV_PER_TOKEN / 2**20, chunked_prefill_tokens=32, init_new_token_ratio=0.2,
                         min_new_token_ratio_factor=0.25)
    cap = engine.capacity
    reqs = []
    shared = [rng.randrange(256) for _ in range(40)]
    for i in range(30):
        prompt = (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randint(1, 80))]
        reqs.append(Req(prompt, SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True)))
    pending = list(reqs)
    steps = 0
    while pending or engine.scheduler.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                engine.add(pending.pop(0))
        engine.step()
        sched = engine.scheduler
        holders = {id(r): r for r in sched.running + (sched._last_extend or []) + [sched.chunked] if r and r.req_pool_idx}
        held = sum(r.kv_len - len(r.prefix_indices) for r in holders.values())
        assert engine.pool.used() <= cap
        assert engine.pool.used() == held + sched.cache.total_size()
        assert sched.req_to_token.available() == engine.cfg.max_running_requests - len(holders)
        steps += 1
        assert steps < 5000
    assert all(r.finish_reason == "length" and len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert engine.scheduler.stats["retractions"] > 0


def test_prompt_longer_than_capacity_is_refused_in_one_sentence():
    engine = make_engine(kv_budget_mb=100 * KV_PER_TOKEN / 2**20)
    with pytest.raises(ValueError, match=r"= 228 tokens, more than a request may hold on this rank: 98 \(its KV "
                                         r"capacity of 100 tokens less 2"):
        engine.add(Req(list(range(100)), SamplingParams(max_new_tokens=128)))
    engine.add(Req(list(range(90)), SamplingParams(max_new_tokens=8)))      # 98 fits


def test_lpm_serves_longest_cached_prefix_first():
    engine = make_engine(max_running_requests=1)
    warm = Req([7] * 60, SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.add(warm)
    while engine.scheduler.has_work():
        engine.step()
    cold = Req([9] * 60, SamplingParams(max_new_tokens=1, ignore_eos=True))
    hot = Req([7] * 60 + [1], SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.add(cold)
    engine.add(hot)
    order = []
    while engine.scheduler.has_work():
        order += [r.rid for r in engine.step() or [] if r.finished]
    assert order == [hot.rid, cold.rid] and hot.cached_tokens == 60


@pytest.mark.parametrize("alternate", [False, True])
def test_chunked_prefill_and_running_decodes(alternate):
    """SGLang runs a prefill batch whenever one can be formed: a 100-token prompt in 8-token chunks stalls the
    running decode for all 13 chunks. servelab's alternate_extend_decode interleaves a decode after every chunk."""
    engine = make_engine(chunked_prefill_tokens=8, alternate_extend_decode=alternate)
    short = Req([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.add(short)
    engine.step()                                   # short is prefilled (its first token), it decodes next
    engine.add(Req(list(range(100)), SamplingParams(max_new_tokens=1, ignore_eos=True)))
    gained = []
    for _ in range(14):
        before = len(short.output_ids)
        engine.step()
        gained.append(len(short.output_ids) - before)
    assert gained == ([1, 0] * 7 if alternate else [0] * 13 + [1])


def test_stop_strings_and_eos():
    engine = make_engine()
    req = Req(list(b"abc"), SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.add(req)
    while engine.scheduler.has_work():
        engine.step()
    text = engine.tokenizer.decode(req.output_ids)
    stop = text[5:7]
    again = Req(list(b"abc"), SamplingParams(max_new_tokens=50, ignore_eos=True, stop=[stop]))
    engine.add(again)
    while engine.scheduler.has_work():
        engine.step()
    assert again.finish_reason == "stop" and len(again.output_ids) < 50


def test_sampling_is_seeded():
    def run(seed):
        engine = Engine(MODEL, EngineConfig(), Parallelism(ParallelConfig(), Group()), MoEConfig(), seed=seed)
        req = Req(list(b"hello"), SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True))
        engine.add(req)
        while engine.scheduler.has_work():
            engine.step()
        return req.output_ids
    assert run(1) == run(1)


@pytest.mark.parametrize("prompt_len", [pytest.param(84, marks=pytest.mark.long), 88,
                                        pytest.param(94, marks=pytest.mark.long)])
@pytest.mark.parametrize("alternate", [False, True])
def test_chunked_prefill_holding_the_pool_finishes_and_loses_nothing(prompt_len, alternate):
    """A prefill in small chunks fills the pool while the only other request has decodes ahead. SGLang's order
    (chunks back to back) needs no retraction. With alternate_extend_decode the decode steps in between run the pool
    dry: the decode is retracted (SGLang would stop here, servelab retracts even the last request), the prefill
    finishes, the retracted request resumes; nothing is lost either way. 94 tokens + 1 do not fit beside the decode's
    6 (SGLang's `total >= rem_total` check): that prefill waits for the decode to finish."""
    engine = make_engine(kv_budget_mb=100 * KV_PER_TOKEN / 2**20, chunked_prefill_tokens=4, init_new_token_ratio=0.0,
                         alternate_extend_decode=alternate)
    decoding = Req([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=93, ignore_eos=True))
    engine.add(decoding)
    engine.step()
    engine.step()
    prefill = Req([200 + i % 50 for i in range(prompt_len)], SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.add(prefill)
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        assert engine.pool.used() <= engine.capacity
        steps += 1
        assert steps < 2000
    assert len(decoding.output_ids) == 93 and len(prefill.output_ids) == 1
    admitted_beside_decode = prompt_len + 1 < engine.capacity - 6
    assert (engine.scheduler.stats["retractions"] > 0) == (alternate and admitted_beside_decode)


def test_the_step_cpu_log_holds_each_steps_shape_as_the_simulator_prices_it_and_its_cpu(tmp_path):
    from script_loader import load_script
    shape_of = load_script("experiments/sim_fidelity/step_shapes.py").shape_of
    engine = make_engine(step_cpu_log=str(tmp_path / "steps"), chunked_prefill_tokens=16)
    shared = list(range(40))
    reqs = [Req(shared + [100 + i] * (5 + i), SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(4)]
    engine.add(reqs[0])
    while engine.scheduler.has_work():
        engine.step()
    for r in reqs[1:]:                      # three together, on the first one's cached prefix
        engine.add(r)
    while engine.scheduler.has_work():
        engine.step()
    (path,) = tmp_path.glob("steps.*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(line["rank"], line["size"], line["dp_rank"]) for line in lines} == {(0, 1, 0)}
    shapes = [shape_of(line["batches"][0]) for line in lines]
    extends = [s for s in shapes if s.mode == "extend"]
    # every prompt token not found in the cache is extended once, in chunks of at most 16
    assert sum(sum(s.new_tokens) for s in extends) == sum(len(r.prompt_ids) - r.cached_tokens for r in reqs)
    assert all(sum(s.new_tokens) <= 16 for s in extends) and max(s.prefix[0] for s in extends) >= 40
    decodes = [s for s in shapes if s.mode == "decode"]
    assert sum(len(s.new_tokens) for s in decodes) == sum(len(r.output_ids) - 1 for r in reqs)
    # a decode step's context is every token its requests hold in KV before it (the first: the prompt; the first
    # output token is this step's new one), one more per request each next step of the same batch (the simulator's
    # decode_shape puts it all on the first request)
    assert decodes[0].prefix == (len(reqs[0].prompt_ids),)
    for a, b in zip(decodes, decodes[1:]):
        if len(a.new_tokens) == len(b.new_tokens):
            assert b.prefix[0] == a.prefix[0] + len(a.new_tokens)
    cpu = engine.timing["extend_cpu_s"] + engine.timing["decode_cpu_s"]
    assert sum(line["cpu_s"] for line in lines) == pytest.approx(cpu, rel=1e-9)
