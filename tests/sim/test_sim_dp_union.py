"""mode=sim's router, not addressing DP groups (router.dp_aware off), sees a multi-group instance as the union of its
groups' blocks, as the real router does (framework/kv_events/union.py): one group evicting or clearing a block that
another group still holds leaves it in the worker's view. Oracle: real radix caches, one per DP group."""
from __future__ import annotations

import torch

from framework.core.registry import ROUTING
from framework.engine.radix_cache import RadixCache
from framework.sim.router import SimRouter

B = 4


def test_one_groups_eviction_keeps_a_block_another_group_holds():
    cls = ROUTING.get("precise_prefix")
    router = SimRouter(cls(cls.Config(block_size=B, pending_credit=False)), ["sim://0"], 1.0, block_size=B)
    groups = [RadixCache(lambda slots: None) for _ in range(2)]
    router.watch("sim://0", groups)
    tokens = list(b"abcdefgh")                               # two whole blocks

    def matched() -> int:
        att, _ = router.send(bytes(tokens + [120]).decode(), tokens + [120], 0.0)
        router.done(att, 0.0)
        return att.decision.matched_chars

    for cache in groups:
        cache.insert(tokens, torch.arange(len(tokens)))
    assert matched() == 8
    groups[0].evict(len(tokens))                             # group 0 drops both blocks; group 1 still holds them
    assert groups[0].match_prefix(tokens)[0].shape[0] == 0 and matched() == 8
    groups[0].insert(tokens, torch.arange(len(tokens)))
    groups[1].reset()                                        # group 1 clears everything; group 0 holds them again
    assert matched() == 8
    groups[0].evict(len(tokens))                             # now no group holds them
    assert matched() == 0
