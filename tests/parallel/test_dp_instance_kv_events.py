"""A two-rank DP-attention instance opened with InstanceSpec.kv_events_block_size hands its parent every DP group's KV
events, each batch stamped with its group (real gloo ranks). Oracle: the blocks each group's batches store are the
chained hashes of the tokens that group served (framework/kv_events/hashing.py), and no other group's. It runs beside
parallel.dp_balance=precise, whose controller follows the same caches (one observer chain per cache): a continued
conversation still goes back to the group that holds it."""
from __future__ import annotations

import asyncio

import pytest

from framework.instance.client import open_engine
from framework.instance.rank_loop import InstanceSpec
from framework.kv_events.events import BlockStored
from framework.kv_events.hashing import chain_hashes
from parallel_helpers import make_cfg
from test_dp_balance_precise import FIRST, last_output

pytestmark = pytest.mark.long
B = 4
OTHER = [(11 * i) % 90 + 3 for i in range(24)]     # a prompt of its own, pinned to group 0


async def turns(client) -> tuple[list[int], int]:
    _, answer = await last_output(client, FIRST, dp_rank=1)
    second, _ = await last_output(client, FIRST + answer + [11, 12, 13, 14])
    await last_output(client, OTHER, dp_rank=0)
    return answer, second.cached_tokens


def test_every_dp_groups_kv_events_reach_the_parent_stamped_with_the_group():
    cfg = make_cfg("parallel=dp_attn", "parallel.size=2", "parallel.timeout_s=20", "parallel.dp_balance=precise",
                   f"parallel.dp_block_size={B}")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed, kv_events_block_size=B))
    batches = []
    client.on_kv_events = batches.append
    try:
        answer, cached = asyncio.run(turns(client))
        client.close()                  # the last step's events come out before the ranks stop
    finally:
        client.terminate()
    assert cached >= len(FIRST)         # the precise controller still sees group 1's cache
    stored = {r: {h for b in batches if b.data_parallel_rank == r for e in b.events if isinstance(e, BlockStored)
                  for h in e.block_hashes} for r in (0, 1)}
    assert {b.data_parallel_rank for b in batches} == {0, 1}
    assert set(chain_hashes(FIRST + answer, B)[:len(FIRST) // B]) <= stored[1]
    assert set(chain_hashes(OTHER, B)) <= stored[0]
    assert not stored[0] & stored[1]
