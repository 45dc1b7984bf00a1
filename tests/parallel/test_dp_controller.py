"""The in-instance DataParallelController: which rank gets each request."""
import pytest
import torch

from framework.contracts.dp_controller import DataParallelController, PrefixRule
from framework.engine.radix_cache import RadixCache


def test_round_robin_cycles_over_ranks_whatever_the_load():
    c = DataParallelController(3, "round_robin")
    c.update([9, 0, 0])
    assert [c.assign() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.assigned == [3, 2, 2]


def test_shortest_queue_counts_what_it_assigned_since_the_last_update():
    c = DataParallelController(3, "shortest_queue")
    c.update([4, 1, 2])
    # brute force: each pick is the rank with the fewest (reported + assigned since), lowest rank on ties
    loads, picks = [4, 1, 2], []
    for _ in range(6):
        want = min(range(3), key=lambda r: (loads[r], r))
        picks.append(c.assign())
        assert picks[-1] == want
        loads[want] += 1
    assert picks == [1, 1, 2, 1, 2, 0]
    c.update([0, 5, 5])               # a fresh report replaces the estimate
    assert c.assign() == 0


def test_a_pinned_request_goes_to_its_rank_and_a_bad_pin_names_the_range():
    c = DataParallelController(2, "round_robin")
    assert c.assign(pinned=1) == 1
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside this instance's ranks 0\.\.1"):
        c.assign(pinned=2)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="parallel.dp_balance='random' is not one of round_robin, shortest_queue, "
                                         "cache_aware, precise"):
        DataParallelController(2, "random")


# -- the prefix-aware policies (servelab's switches; sgl-router's rule) ------------------------------------------------
RULE = PrefixRule(block_size=4, cache_threshold=0.5, balance_abs_threshold=3)


def _prompt(conv: int, length: int) -> list[int]:
    return [1000 * conv + i for i in range(length)]


def test_cache_aware_sends_a_conversation_back_to_the_group_it_sent_it_to():
    c = DataParallelController(4, "cache_aware", RULE)
    first = [c.assign(prompt_ids=_prompt(conv, 16)) for conv in range(4)]
    assert sorted(first) == [0, 1, 2, 3]      # no match anywhere: the smallest view, so the groups fill in turn
    for conv in (2, 0, 3, 1):                 # the next turns extend the first prompts
        assert c.assign(prompt_ids=_prompt(conv, 24)) == first[conv]
    assert c.prefix_hits == 4


def test_cache_aware_falls_back_to_the_shortest_queue_when_the_loads_are_imbalanced():
    c = DataParallelController(2, "cache_aware", RULE)
    assert c.assign(prompt_ids=_prompt(7, 16)) == 0
    c.update([10, 1])                          # 10 - 1 > balance_abs_threshold: the match no longer decides
    assert c.assign(prompt_ids=_prompt(7, 24)) == 1


def test_a_short_match_does_not_decide():
    c = DataParallelController(2, "cache_aware", RULE)
    assert c.assign(prompt_ids=_prompt(1, 8)) == 0
    # 8 matched tokens of 40 is under cache_threshold: the group with the smaller view (1) takes it
    assert c.assign(prompt_ids=_prompt(1, 8) + _prompt(9, 32)) == 1


def _cache_with_slots():
    return RadixCache(free_slots=lambda value: None)


def test_precise_follows_each_groups_kv_events_and_forgets_what_a_group_evicted():
    c = DataParallelController(2, "precise", RULE)
    caches = [_cache_with_slots(), _cache_with_slots()]
    for rank, cache in enumerate(caches):
        c.watch(rank, cache)
    prompt = _prompt(5, 16)
    caches[1].insert(prompt, torch.arange(16))          # group 1 really holds the prompt
    c.update([0, 0])
    assert c.assign(prompt_ids=prompt + [1, 2, 3, 4]) == 1
    assert caches[1].evict(16) == 16                    # evicted: the view empties, the queues decide again
    c.update([0, 1])
    assert c.assign(prompt_ids=prompt) == 0
    assert c.prefix_hits == 1


def test_precise_keeps_another_observer_of_the_cache_and_rejoins_one_that_replaced_it():
    class Recorder:
        def __init__(self):
            self.stored_keys = []

        def stored(self, key, start):
            self.stored_keys.append(list(key))

        def evicted(self, leaf):
            pass

        def cleared(self):
            pass

    c = DataParallelController(2, "precise", RULE)
    cache = _cache_with_slots()
    c.watch(0, cache)
    router = Recorder()
    cache.observer = router                              # e.g. the simulated router's emitter, set afterwards
    c.assign(prompt_ids=_prompt(3, 4))                   # the controller joins it again (a Tee)
    cache.insert(_prompt(3, 8), torch.arange(8))
    assert router.stored_keys == [_prompt(3, 8)]
    c.update([0, 0])
    assert c.assign(prompt_ids=_prompt(3, 8)) == 0 and c.prefix_hits == 1
