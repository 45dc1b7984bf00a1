"""Prefill/decode disaggregation on real one-rank instances in this process, paired through real transports and ZMQ
on loopback (what a prefill and a decode worker run, without HTTP).

The oracle: a request served by a prefill instance and a decode instance returns the tokens and the logits of one
mixed instance, and the KV the decode instance received (and then computed) equals the mixed instance's, bit for
bit. Faults: a missing peer on either side times out with an error, a client that leaves on either side frees
what its half held at once, and every pre-allocated slot and row goes back (the pool counters return to their start).
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from framework.dist.kv_transfer import resolve_backend
from framework.engine.request import SamplingParams
from framework.instance.client import open_engine
from pd_helpers import base_cfg, collect, counters, pairing_for, spec, wait_async

pytestmark = pytest.mark.long     # five one-rank instances: ~15 s on this machine

PROMPTS = ["disaggregate the prefill from the decode", "disaggregate the prefill, then route", "x"]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
TRANSPORTS = ["tcp"] + (["mooncake"] if resolve_backend("auto") == "mooncake" else [])


def logit_rows(client) -> dict:
    rows: dict[tuple, list] = {}
    client.local_engine.logit_hook = lambda req, row: rows.setdefault(tuple(req.prompt_ids), []).append(row.clone())
    return rows


def cached_kv(client, ids: list[int]) -> torch.Tensor:
    """The KV the instance's radix cache holds for `ids` (every layer), read from its pool."""
    engine = client.local_engine
    slots, _ = engine.scheduler.cache.match_prefix(ids)
    assert len(slots) == len(ids), "the instance's cache does not hold the whole sequence"
    return engine.pool.buffer[:, slots.long()].clone()


@pytest.fixture(scope="module")
def cfg():
    return base_cfg()


@pytest.fixture(scope="module")
def mixed(cfg):
    client = open_engine(spec(cfg))
    yield client
    client.close()


@pytest.mark.parametrize("transport, reuse", [(t, False) for t in TRANSPORTS] + [("tcp", True)])
def test_pd_returns_the_mixed_instances_tokens_logits_and_kv(cfg, mixed, transport, reuse):
    engine = {"disaggregation_transfer_backend": transport}
    pre_spec = spec(cfg, "prefill", **engine)
    prefill = open_engine(pre_spec)
    decode = open_engine(spec(cfg, "decode", disaggregation_decode_prefix_reuse=reuse, **engine))
    try:
        mixed_rows, pre_rows, dec_rows = logit_rows(mixed), logit_rows(prefill), logit_rows(decode)
        start = counters(decode)

        async def scenario():
            out = []
            for prompt in PROMPTS:                   # one at a time: the same batches on both paths
                want, _ = await collect(mixed, prompt, GREEDY)
                pairing = pairing_for(pre_spec)
                (first, _), (got, last) = await asyncio.gather(collect(prefill, prompt, GREEDY, pairing),
                                                               collect(decode, prompt, GREEDY, pairing))
                out.append((prompt, want, first, got, last))
            return out

        served = asyncio.run(scenario())
        bytes_per_token = mixed.local_engine.memory.kv_bytes_per_token
        for i, (prompt, want, first, got, last) in enumerate(served):
            ids = mixed.tokenizer.encode(prompt)
            assert got == want and first == want[:1], prompt
            torch.testing.assert_close(torch.stack(pre_rows[tuple(ids)] + dec_rows[tuple(ids)]),
                                       torch.stack(mixed_rows[tuple(ids)]), rtol=0, atol=1e-6)
            sequence = ids + got[:-1]                # what holds KV once the request finished
            assert torch.equal(cached_kv(decode, sequence), cached_kv(mixed, sequence)), prompt
            if not (reuse and i == 1):               # the second prompt shares a prefix with the first
                assert last.kv_transfer_bytes == len(ids) * bytes_per_token and last.kv_transfer_s > 0
        if reuse:                                    # the decode side received only what its cache lacked
            shared = len(mixed.tokenizer.encode(PROMPTS[1])) - served[1][4].kv_transfer_bytes // bytes_per_token
            assert shared >= len("disaggregate the prefill")
        assert counters(decode) == start and counters(prefill)["slots_in_use"] == 0
        assert decode.stats()["kv_transfer_backend"] == transport
        assert prefill.stats()["kv_transfer_bytes"] == decode.stats()["kv_transfer_bytes"] > 0
    finally:
        prefill.close()
        decode.close()


def test_faults_fail_the_request_and_free_every_slot(cfg):
    """A missing prefill side times out on the decode side and a missing decode side on the prefill side (errors,
    not hangs); a client that leaves frees its half at once, well before the timeout."""
    short = {"disaggregation_transfer_backend": "tcp", "disaggregation_timeout_s": 1.0}
    pre_spec = spec(cfg, "prefill", **short)
    prefill, decode = open_engine(pre_spec), open_engine(spec(cfg, "decode", **short))
    try:
        start_p, start_d = counters(prefill), counters(decode)
        long = SamplingParams(max_new_tokens=40, ignore_eos=True)

        async def scenario():
            # the decode half alone: its prefill half never comes
            with pytest.raises(RuntimeError, match="KV transfer failed: (the prefill instance got no request|no KV from the prefill)"):
                await collect(decode, "lonely decode half", long, pairing_for(pre_spec))
            # the prefill half alone: no decode instance asks for the room
            with pytest.raises(RuntimeError, match="no decode instance asked for room"):
                await collect(prefill, "lonely prefill half", long, pairing_for(pre_spec))
            # the decode client leaves while its slots wait for KV: the cancel frees them now, not at the timeout
            task = asyncio.create_task(collect(decode, "impatient client " * 4, long, pairing_for(pre_spec)))
            await wait_async(lambda: counters(decode)["kv_receiving"] == 1, what="slots pre-allocated")
            task.cancel()
            await wait_async(lambda: counters(decode) == start_d, timeout=0.8, what="decode slots freed")
            # the prefill client leaves while it waits for its destination (SGLang's order: it holds no KV yet)
            task = asyncio.create_task(collect(prefill, "impatient prefill " * 4, long, pairing_for(pre_spec)))
            await wait_async(lambda: counters(prefill)["kv_bootstrapping"] == 1, what="prefill parked")
            task.cancel()
            await wait_async(lambda: counters(prefill) == start_p, timeout=0.8, what="prefill KV released")

        asyncio.run(scenario())
        assert counters(prefill) == start_p and counters(decode) == start_d
        assert prefill.stats()["kv_transfer_failures"] >= 2 and decode.stats()["kv_transfer_failures"] >= 1
    finally:
        prefill.close()
        decode.close()


def test_tp_prefill_and_dp_attention_decode_move_the_latent_into_the_right_ranks(mixed):
    """parallel=tp x2 on the prefill side (its rank 0 sends: every rank holds the whole MLA latent) and dp_attn x2
    on the decode side (requests spread over its two DP groups; a group's leader reports its slots to rank 0, and
    the KV goes to that group's rank only): every answer is the mixed instance's."""
    engine = {"disaggregation_transfer_backend": "tcp"}
    pre_spec = spec(base_cfg("parallel=tp", "parallel.size=2"), "prefill", **engine)
    prefill = open_engine(pre_spec)
    decode = open_engine(spec(base_cfg("parallel=dp_attn", "parallel.size=2"), "decode", **engine))
    try:
        async def scenario():
            want = [await collect(mixed, p, GREEDY) for p in PROMPTS]
            pairs = [pairing_for(pre_spec) for _ in PROMPTS]
            got = await asyncio.gather(*(collect(side, p, GREEDY, pairing) for p, pairing in zip(PROMPTS, pairs)
                                         for side in (prefill, decode)))
            return want, got[1::2]

        want, got = asyncio.run(scenario())
        per_token = mixed.local_engine.memory.kv_bytes_per_token
        for prompt, (tokens, _), (dtokens, last) in zip(PROMPTS, want, got):
            assert dtokens == tokens, prompt
            assert last.kv_transfer_bytes == len(mixed.tokenizer.encode(prompt)) * per_token   # one rank's pool
        for client in (prefill, decode):
            stats = client.stats()
            assert stats["kv_used_tokens"] == stats["cache_tokens"] and stats["kv_receiving"] == 0
        per_group = decode.stats()["requests_per_rank"]           # dp_attn x2: a rank is a DP group
        assert sum(per_group) == len(PROMPTS) and min(per_group) > 0
    finally:
        prefill.close()
        decode.close()
