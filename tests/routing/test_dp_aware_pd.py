"""router.dp_aware beyond one policy: a reset of one DP group (a worker that publishes per rank lost one rank's
batches), and P/D role policies that address DP groups (framework/routing/pairs.py role_policies), sharing what the
router learnt of each worker's dp_size. No I/O: the router core and real policies."""
from __future__ import annotations

import pytest

from framework.contracts.routing import EVENTS_LOST
from framework.core.registry import ROUTING
from framework.kv_events.events import BlockStored, KVEventBatch
from framework.routing.core import RouterCore
from framework.routing.dp_aware import DPAware, RankReset, dp_rank_of
from framework.routing.pairs import ALWAYS, DECODE, DECODE_FIRST, PREFILL, dispatch_pair, role_policies

B = 4
P, D = "http://p:1", "http://d:1"


def stored(text: str, rank: int) -> KVEventBatch:
    tokens = tuple(text.encode())[: len(text) // B * B]
    return KVEventBatch(0.0, (BlockStored(tuple(hash((text, i)) for i in range(len(tokens) // B)), None, tokens, B),),
                        rank)


def test_a_rank_reset_voids_that_groups_view_only():
    cls = ROUTING.get("precise_prefix")
    inner = cls(cls.Config(block_size=B, pending_credit=False))
    core = RouterCore(DPAware(inner, lambda url: 3))
    core.add_worker(P, healthy=True)
    text = "the same prefix on every group"
    core.worker_events(P, [stored(text, r) for r in range(3)])
    keys = inner.view.keys.chain(text.encode())
    held = lambda: [inner.view.match(keys, [f"{P}@{r}"])[f"{P}@{r}"] for r in range(3)]  # noqa: E731
    assert held() == [len(text) // B] * 3
    core.worker_events(P, [RankReset(1, EVENTS_LOST), RankReset(7, EVENTS_LOST)])   # a rank it has not: nothing
    assert held() == [len(text) // B, 0, len(text) // B]


def _pd_core(name: str, sizes: dict) -> RouterCore:
    cls = ROUTING.get(name)
    outer = DPAware(cls(cls.Config()), lambda url: 1)
    core = RouterCore(outer, clock=lambda: 0.0)
    core.set_role_policies(role_policies(outer, dp_aware=True))
    for url, n in sizes.items():
        core.add_worker(url, healthy=True)
        outer.set_dp_size(url, n)                    # learnt (the KV-event subscription asks) before the role is known
    core.set_role(P, PREFILL)
    core.set_role(D, DECODE)
    return core


@pytest.mark.parametrize("decider", [ALWAYS, DECODE_FIRST])
def test_role_policies_address_groups_and_keep_what_was_learnt_before_the_role(decider):
    core = _pd_core("round_robin", {P: 2, D: 3})
    pp, dp = core.role_policies[PREFILL], core.role_policies[DECODE]
    assert isinstance(pp, DPAware) and isinstance(dp, DPAware) and pp.learnt is dp.learnt is core.policy.learnt
    assert pp.sizes == {P: 2} and dp.sizes == {D: 3}
    plans = [dispatch_pair(core, "x", [core.workers[P]], [core.workers[D]], decider) for _ in range(6)]
    assert [dp_rank_of(pl.decode.decision) for pl in plans] == [0, 1, 2, 0, 1, 2]
    if decider == ALWAYS:
        assert [dp_rank_of(pl.prefill.decision) for pl in plans] == [0, 1, 0, 1, 0, 1]
    for pl in plans:
        for att in (pl.prefill, pl.decode):
            if att is not None:
                att.served = True
                core.release(att)
    assert not any(pp.inner.loads.values()) and not any(dp.inner.loads.values())
    assert role_policies(core.policy, dp_aware=False)[PREFILL].__class__ is pp.inner.__class__   # mode=sim's


def test_a_pair_without_a_decode_side_releases_the_prefill_groups_count():
    core = _pd_core("round_robin", {P: 2, D: 3})
    pp = core.role_policies[PREFILL]
    with pytest.raises(ValueError):
        dispatch_pair(core, "x", [core.workers[P]], [core.workers[P]])   # no decode worker in the decode pool
    assert not any(pp.loads.values()) and not any(pp.inner.loads.values())


def test_a_pair_without_a_prefill_side_releases_the_decode_groups_count():
    """decode_first picks the decode half first: a prefill select that fails leaves no decode half counted."""
    core = _pd_core("round_robin", {P: 2, D: 3})
    dp = core.role_policies[DECODE]
    with pytest.raises(ValueError):
        dispatch_pair(core, "x", [core.workers[D]], [core.workers[D]], DECODE_FIRST)   # no prefill worker in its pool
    assert not any(dp.loads.values()) and not any(dp.inner.loads.values())


def test_what_was_learnt_of_a_removed_worker_is_forgotten_once_no_role_holds_it():
    """A router runs for weeks with workers coming and going: the dp_sizes its DP-aware role policies share keep only
    the workers some role still holds (a worker moving between roles keeps its groups, a removed one is forgotten)."""
    core = _pd_core("round_robin", {P: 2, D: 3})
    learnt = core.policy.learnt
    core.maintain()
    assert learnt == {P: 2, D: 3}                        # both held by their role's policy
    core.set_role(D, None)                               # back to the router's own policy: still held, still known
    core.maintain()
    assert learnt == {P: 2, D: 3} and core.policy.sizes[D] == 3
    core.remove_worker(D)
    core.maintain()
    assert learnt == {P: 2}
    core.add_worker(D, healthy=True)                     # the same URL again: a new worker, asked afresh
    assert core.policy.sizes[D] == 1
