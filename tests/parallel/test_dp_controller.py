"""The in-instance DataParallelController: which rank gets each request."""
import pytest

from framework.contracts.dp_controller import DataParallelController


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
    with pytest.raises(ValueError, match="parallel.dp_balance='random' is not one of round_robin, shortest_queue"):
        DataParallelController(2, "random")
