"""dp_balance=precise across processes, without the processes: a group's radix cache on another rank relays its KV
events (framework/kv_events/relay.py) as batches stamped with its data_parallel_rank; pickled as the step's exchange
carries them and fed to the controller, they steer it as watching the cache in place does (the long test
test_dp_balance_precise.py runs the same on real gloo ranks)."""
from __future__ import annotations

import pickle

import pytest
import torch

from framework.contracts.dp_controller import DataParallelController, PrefixRule
from framework.engine.radix_cache import RadixCache
from framework.kv_events.events import BlockStored, KVEventBatch

RULE = PrefixRule(block_size=4, cache_threshold=0.5, balance_abs_threshold=3)


def test_relayed_events_steer_the_controller_and_its_evictions_too():
    c = DataParallelController(2, "precise", RULE)
    remote = RadixCache(free_slots=lambda value: None)
    relay = DataParallelController(2, "precise", RULE).relay(1, remote)    # built on rank 1, from the same config
    prompt = list(range(100, 116))
    remote.insert(prompt, torch.arange(16))
    batches = pickle.loads(pickle.dumps(relay.drain()))
    assert [b.data_parallel_rank for b in batches] == [1] and relay.drain() == []
    for b in batches:
        c.feed(b)
    c.update([0, 0])
    assert c.assign(prompt_ids=prompt + [1, 2]) == 1 and c.prefix_hits == 1
    assert remote.evict(16) == 16
    for b in relay.drain():
        c.feed(b)
    c.update([0, 0])
    assert c.assign(prompt_ids=prompt) == 0                    # forgotten: the shortest queue (ties: group 0)


def test_a_relay_keeps_the_caches_other_observer_and_only_precise_relays():
    class Counter:
        stores = 0

        def stored(self, key, start):
            Counter.stores += 1

        def evicted(self, leaf):
            pass

        def cleared(self):
            pass

    cache = RadixCache(free_slots=lambda value: None)
    cache.observer = Counter()
    relay = DataParallelController(2, "precise", RULE).relay(1, cache)
    cache.insert(list(range(8)), torch.arange(8))
    assert Counter.stores == 1 and isinstance(relay.drain()[0].events[0], BlockStored)
    assert DataParallelController(2, "cache_aware", RULE).relay(1, cache) is None


@pytest.mark.parametrize("rank", [None, 2, -1])
def test_a_batch_without_a_group_of_this_instance_is_refused(rank):
    with pytest.raises(ValueError, match="data_parallel_rank"):
        DataParallelController(2, "precise", RULE).feed(KVEventBatch(0.0, (), rank))
