"""parallel.dp_balance=precise on a real two-rank DP-attention instance (spawned ranks, gloo): rank 1's radix cache
relays its KV events to rank 0's controller in the step's exchange, so a request that continues a conversation
group 1 served goes back to group 1 and hits its cache. shortest_queue, prefix-blind, is the control: both groups
idle, it picks group 0 and the continuation misses."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from framework.engine.request import SamplingParams
from framework.instance.client import open_engine
from framework.instance.handle import generate
from framework.instance.rank_loop import InstanceSpec
from parallel_helpers import make_cfg

pytestmark = pytest.mark.long

FIRST = [(7 * i) % 90 + 5 for i in range(40)]     # 40 prompt tokens: ten 4-token blocks
NEW = 4


async def last_output(client, prompt: list[int], dp_rank: int | None = None):
    out = None
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    async with aclosing(generate(client, prompt, params, dp_rank)) as outputs:
        tokens = []
        async for out in outputs:
            tokens += out.token_ids
    return out, tokens


async def conversation(client) -> int:
    """Turn 1 pinned to group 1; turn 2 (turn 1's prompt and answer plus a question) left to the controller: the
    tokens turn 2 found cached."""
    _, answer = await last_output(client, FIRST, dp_rank=1)
    second, _ = await last_output(client, FIRST + answer + [11, 12, 13, 14])
    return second.cached_tokens


@pytest.mark.parametrize("balance", ["precise", "shortest_queue"])
def test_a_continued_conversation_goes_to_the_group_that_holds_its_prefix(balance, capfd):
    cfg = make_cfg("parallel=dp_attn", "parallel.size=2", "parallel.timeout_s=20", f"parallel.dp_balance={balance}",
                   "parallel.dp_block_size=4")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
    try:
        cached = asyncio.run(conversation(client))
    finally:
        client.terminate()
    if balance == "precise":
        assert cached >= len(FIRST)            # group 1's cache: the first turn's prompt (and part of its answer)
    else:
        assert cached == 0                     # group 0 never saw the conversation
    assert "no DP group's KV events reach this controller" not in capfd.readouterr().err
