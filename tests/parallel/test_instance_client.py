"""The async face of a multi-rank instance (what the HTTP worker calls): streamed greedy outputs equal the
reference model's greedy continuation, aborts free the request on its rank, flush and stats work, and a rank
killed mid-run fails the requests in flight with one message and leaves no process behind."""
import asyncio
import os
import signal
from contextlib import aclosing

import pytest

from framework.instance.handle import generate
from framework.instance.rank_loop import InstanceSpec
from framework.instance.client import InstanceClient, open_engine
from framework.engine.request import SamplingParams
from framework.model.model import build_model
from framework.model.reference import reference_forward
from parallel_helpers import assert_no_rank_left, make_cfg

PROMPTS = ["The cache", "route the expert latent", "x", "decode prefill rank queue model serve"]
NEW_TOKENS = 8


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(reference_forward(model, ids)[-1].argmax()))
    return ids[-n:]


async def collect(stream) -> tuple[list[int], str, object]:
    tokens, text, last = [], "", None
    async with aclosing(stream) as outputs:
        async for out in outputs:
            tokens += out.token_ids
            text += out.text
            last = out
    return tokens, text, last


async def scenario(client: InstanceClient) -> dict:
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    served = await asyncio.gather(*(collect(generate(client, p, greedy)) for p in PROMPTS))
    info_busy = client.stats()
    # abort: stop reading a long request after two outputs; its rank must drop it
    async with aclosing(generate(client, "a long one " * 3, SamplingParams(max_new_tokens=400, ignore_eos=True))) as s:
        async for i, _ in _enumerate(s):
            if i == 1:
                break
    for _ in range(100):
        await asyncio.sleep(0.05)
        if client.stats()["running_requests"] + client.stats()["queued_requests"] == 0:
            break
    info_idle = client.stats()
    flushed = await client.flush_cache()
    # a rank dies while a request streams
    stream = generate(client, "doomed", SamplingParams(max_new_tokens=400, ignore_eos=True))
    first = await stream.__anext__()
    os.kill(client.instance.pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError) as dead:
        async for _ in stream:
            pass
    return {"served": served, "busy": info_busy, "idle": info_idle, "flushed": flushed, "first": first,
            "dead": str(dead.value)}


async def _enumerate(stream):
    i = 0
    async for item in stream:
        yield i, item
        i += 1


def test_generate_streams_the_reference_greedy_tokens_and_a_dead_rank_fails_cleanly():
    cfg = make_cfg("parallel=dp_attn", "parallel.size=2", "parallel.timeout_s=10")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
    pids = client.instance.pids
    try:
        out = asyncio.run(scenario(client))
    finally:
        client.terminate()
    model = build_model(cfg.model, cfg.seed)
    for prompt, (tokens, text, last) in zip(PROMPTS, out["served"]):
        ids = client.tokenizer.encode(prompt)
        assert tokens == greedy_reference(model, ids, NEW_TOKENS)
        assert text == client.tokenizer.decode(tokens)
        assert (last.finished, last.finish_reason, last.prompt_tokens, last.completion_tokens) == \
            (True, "length", len(ids), NEW_TOKENS)
    assert out["busy"]["parallel"] == "dp_attn" and out["busy"]["parallel_size"] == 2
    assert out["busy"]["kv_capacity_tokens_instance"] == 2 * out["busy"]["kv_capacity_tokens_per_rank"]
    assert out["idle"]["running_requests"] == out["idle"]["queued_requests"] == 0   # the aborted one is gone
    assert out["flushed"] is True
    assert out["first"].token_ids and not out["first"].finished
    assert out["dead"].startswith("engine is down: rank 1 failed: RankDied: rank 1 exited without reporting")
    assert client.error is not None
    assert_no_rank_left(pids)
    with pytest.raises(RuntimeError, match="engine is down"):
        asyncio.run(collect(generate(client, "after", SamplingParams(max_new_tokens=2))))
