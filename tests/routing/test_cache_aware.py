"""cache_aware: each decision rule at and just past its thresholds (strict >, as SGLang), tie breaks, miss policies,
eviction timing, worker removal, and a property test against a brute-force re-implementation of the rule that keeps
the plain list of texts sent to each worker instead of a tree."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from framework.core.registry import ROUTING
from framework.contracts.routing import NoWorkerAvailable

CacheAware = ROUTING.get("cache_aware")


def make(workers="abc", clock=None, **overrides):
    policy = CacheAware(CacheAware.Config(**overrides))
    if clock is not None:
        policy.clock = clock
    for w in workers:
        policy.add_worker(w)
    return policy


def send(policy, text, worker):
    """Route ``text`` to ``worker`` (the only candidate) and release it, so only the tree changes."""
    assert policy.select(text, workers=[worker]) == worker
    policy.on_request_done(worker)


# -- load balance: (max - min) > abs AND max > min * rel --------------------------------------------------------------
@pytest.mark.parametrize("loads, expected", [((3, 1), "cache"), ((4, 1), "balance")])
def test_balance_abs_threshold_is_strict(loads, expected):
    policy = make("ab", balance_abs_threshold=2, balance_rel_threshold=1.0)
    send(policy, "hello world", "a")
    policy.loads.update(a=loads[0], b=loads[1])
    assert policy.select("hello world") == ("a" if expected == "cache" else "b")
    assert policy.last_decision.reason == ("cache_hit" if expected == "cache" else "balance")


@pytest.mark.parametrize("loads, expected", [((4, 2), "cache_hit"), ((5, 2), "balance")])
def test_balance_rel_threshold_is_strict(loads, expected):
    policy = make("ab", balance_abs_threshold=0, balance_rel_threshold=2.0)
    send(policy, "hello world", "a")
    policy.loads.update(a=loads[0], b=loads[1])
    policy.select("hello world")
    assert policy.last_decision.reason == expected


def test_sglang_defaults_balance_once_the_gap_exceeds_32():
    policy = make("ab")
    send(policy, "hello world", "a")
    policy.loads.update(a=32, b=0)
    assert policy.select("hello world") == "a"
    policy.loads.update(a=33, b=0)
    assert policy.select("hello world") == "b" and policy.last_decision.reason == "balance"


def test_balance_is_measured_over_the_candidates_only():
    policy = make("abc", balance_abs_threshold=0, balance_rel_threshold=1.0)
    send(policy, "hello world", "a")
    policy.loads.update(a=5, b=5, c=0)  # c is out of the candidates: a and b are balanced
    assert policy.select("hello world", workers=["a", "b"]) == "a"
    assert policy.last_decision.reason == "cache_hit"


# -- cache hit / miss: matched / request chars > cache_threshold -----------------------------------------------------
@pytest.mark.parametrize("threshold, reason, worker", [(0.5, "cache_miss", "b"), (0.49, "cache_hit", "a")])
def test_cache_threshold_is_strict(threshold, reason, worker):
    policy = make("ab", cache_threshold=threshold)
    send(policy, "abcd", "a")
    assert policy.select("abcdefgh") == worker  # 4 / 8 = 0.5 exactly
    d = policy.last_decision
    assert (d.reason, d.request_chars) == (reason, 8)
    assert d.matched_chars == (4 if worker == "a" else 0)  # what the chosen worker already had


def test_miss_goes_to_the_smallest_tree_with_ties_in_insertion_order():
    policy = make("abc")
    send(policy, "a long text sent to a", "a")
    send(policy, "short b", "b")
    assert policy.select("zzz") == "c"
    assert policy.select("yyyyyyyyyyyyyy") == "c"  # c holds 3 chars: still the smallest
    assert policy.select("q" * 40) == "b"


def test_miss_policy_least_loaded():
    policy = make("abc", miss_policy="least_loaded")
    send(policy, "tiny", "a")
    policy.loads.update(a=1, b=2, c=2)
    assert policy.select("unrelated text") == "a"
    assert policy.last_decision.reason == "cache_miss"


def test_empty_request_is_a_miss():
    policy = make("ab")
    send(policy, "some text", "a")
    assert policy.select("") == "b" and policy.last_decision.reason == "cache_miss"


# -- several workers hold the longest match ---------------------------------------------------------------------------
@pytest.mark.parametrize("tie_break, expected", [("least_loaded", "c"), ("most_recent", "b"), ("first", "a")])
def test_tie_break(tie_break, expected):
    clock = itertools.count(1).__next__
    policy = make("abcd", clock=clock, tie_break=tie_break, balance_abs_threshold=100)
    for w in "acb":  # b is sent the prefix last
        send(policy, "shared prefix", w)
    send(policy, "shared other", "d")  # d holds a shorter match only
    policy.loads.update(a=3, b=2, c=1, d=0)
    assert policy.select("shared prefix, continued") == expected
    d = policy.last_decision
    assert (d.reason, d.matched_chars) == ("cache_hit", len("shared prefix"))


def test_candidates_restrict_the_match_to_the_longest_a_candidate_holds():
    policy = make("abc", cache_threshold=0.3)
    send(policy, "abcdefgh", "a")
    send(policy, "abcxyz", "b")
    assert policy.select("abcdefgh", workers=["b", "c"]) == "b"  # b holds 3 of 8 chars > 0.3
    assert policy.last_decision.matched_chars == 3


# -- eviction, removal, loads ------------------------------------------------------------------------------------------
def test_maintain_evicts_only_after_the_interval():
    now = [0.0]
    # 330 chars: past max_tree_size but within the slack (320 / 32) that the insert-time bound allows
    policy = make("ab", clock=lambda: now[0], eviction_interval_secs=10, max_tree_size=320)
    text = "0123456789" * 33
    send(policy, text, "a")
    policy.maintain(0.0)  # starts the interval
    policy.maintain(9.99)
    assert policy.tree.tenant_size("a") == 330
    policy.maintain(10.0)
    assert policy.tree.tenant_size("a") == 0  # one 330-char leaf, over the bound of 320: it goes
    send(policy, text, "a")
    policy.maintain(15.0)  # the next pass is due at 20
    assert policy.tree.tenant_size("a") == 330


def test_remove_worker_purges_it_from_the_tree():
    policy = make("ab")
    send(policy, "only a has this", "a")
    send(policy, "only b has that", "b")
    policy.remove_worker("a")
    assert policy.tree.tenant_size("a") == 0 and "a" not in policy.tree.tenants()
    assert policy.tree.total_chars == len("only b has that")
    assert policy.tree.match("only a has this")[:2] == (len("only "), {"b": policy.tree.root.children["o"].tenants["b"]})
    assert all(policy.select(t) == "b" for t in ["only a has this", "x", ""])
    with pytest.raises(ValueError, match="unknown worker 'a'"):
        policy.remove_worker("a")


def test_loads_never_go_negative_and_unknown_workers_are_ignored():
    policy = make("ab")
    w = policy.select("x")
    policy.on_request_done(w)
    policy.on_request_done(w)
    policy.on_request_done("gone")
    assert policy.loads == {"a": 0, "b": 0}


def test_unhealthy_workers_are_left_out_but_keep_their_tree():
    policy = make("ab")
    send(policy, "hello world", "a")
    policy.set_healthy("a", False)
    assert policy.select("hello world") == "b"
    policy.set_healthy("a")
    assert policy.select("hello world") == "a"
    policy.set_healthy("b", False)
    policy.set_healthy("a", False)
    with pytest.raises(NoWorkerAvailable):
        policy.select("x")


@pytest.mark.parametrize("field, value, allowed", [
    ("tie_break", "oldest", "least_loaded"), ("miss_policy", "random", "smallest_tree"),
    ("cache_threshold", 1.5, "[0, 1]"), ("eviction_interval_secs", 0, "> 0")])
def test_bad_config_names_the_field_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=field) as err:
        CacheAware(CacheAware.Config(**{field: value}))
    assert allowed in str(err.value)


# -- against a brute-force reference ----------------------------------------------------------------------------------
def lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Reference:
    """The rule written plainly over the texts sent to each worker (no tree)."""

    def __init__(self, cfg, workers):
        self.cfg, self.order = cfg, list(workers)
        self.sent = {w: [] for w in workers}  # worker -> [(text, time)]
        self.loads = {w: 0 for w in workers}

    def select(self, text, candidates, now):
        cfg, loads = self.cfg, self.loads
        cands = [w for w in self.order if w in candidates]
        best_of = {w: max((lcp(text, s) for s, _ in self.sent[w]), default=0) for w in cands}
        hi, lo = max(loads[w] for w in cands), min(loads[w] for w in cands)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            worker, reason = min(cands, key=loads.get), "balance"
        elif text and max(best_of.values()) / len(text) > cfg.cache_threshold:
            best = max(best_of.values())
            holders = [w for w in cands if best_of[w] == best]
            reason = "cache_hit"
            if cfg.tie_break == "least_loaded":
                worker = min(holders, key=loads.get)
            elif cfg.tie_break == "first":
                worker = holders[0]
            else:  # the last time each holder was sent text through the matched point
                worker = max(holders, key=lambda w: max(t for s, t in self.sent[w] if lcp(text, s) >= best))
        else:
            reason = "cache_miss"
            if cfg.miss_policy == "smallest_tree":
                size = {w: len({s[:i] for s, _ in self.sent[w] for i in range(1, len(s) + 1)}) for w in cands}
                worker = min(cands, key=size.get)
            else:
                worker = min(cands, key=loads.get)
        matched = best_of[worker]
        self.sent[worker].append((text, now))
        loads[worker] += 1
        return worker, matched, reason


configs = st.builds(
    CacheAware.Config,
    cache_threshold=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    balance_abs_threshold=st.sampled_from([0, 2, 100]),
    balance_rel_threshold=st.sampled_from([0.0, 1.0, 1.5]),
    tie_break=st.sampled_from(["least_loaded", "most_recent", "first"]),
    miss_policy=st.sampled_from(["smallest_tree", "least_loaded"]),
)
steps = st.lists(st.one_of(
    # a few repeated texts and single-worker sends make ties between workers holding the same prefix common
    st.tuples(st.just("select"), st.one_of(st.sampled_from(["abab", "abba", "ab", "b"]), st.text("ab", max_size=8)),
              st.one_of(st.none(), st.sampled_from("xyz").map(set), st.sets(st.sampled_from("xyz"), min_size=1))),
    st.tuples(st.just("done"), st.sampled_from("xyz"), st.none()),
), min_size=10, max_size=60)


@settings(max_examples=300, deadline=None)
@given(configs, steps)
def test_decisions_match_the_brute_force_reference(cfg, sequence):
    clock = itertools.count(1)
    now = [0]
    policy = CacheAware(cfg)
    policy.clock = lambda: now[0]
    for w in "xyz":
        policy.add_worker(w)
    ref = Reference(cfg, "xyz")
    for op, arg, candidates in sequence:
        if op == "done":
            policy.on_request_done(arg)
            ref.loads[arg] = max(0, ref.loads[arg] - 1)
            continue
        now[0] = next(clock)
        worker = policy.select(arg, workers=None if candidates is None else sorted(candidates))
        d = policy.last_decision
        expected = ref.select(arg, candidates or set("xyz"), now[0])
        assert (worker, d.matched_chars, d.reason) == expected, f"request {arg!r}"
        assert policy.loads == ref.loads


@pytest.mark.parametrize("follow", [False, True])
def test_follow_flushes_forgets_a_worker_flushed_behind_the_routers_back(follow):
    """SGLang's tree keeps a worker's entries when the worker is flushed directly (default); ``follow_flushes``
    (servelab's) subscribes to the KV events for their AllBlocksCleared and forgets that worker then."""
    from framework.contracts.routing import KV_EVENTS, NotExpressible
    from framework.kv_events.events import AllBlocksCleared
    policy = make("ab", follow_flushes=follow, miss_policy="least_loaded")
    assert (KV_EVENTS in policy.subscriptions) is follow
    send(policy, "only a has this", "a")
    policy.on_worker_event("a", AllBlocksCleared())
    assert (policy.tree.tenant_size("a") == 0) is follow
    if follow:
        with pytest.raises(NotExpressible, match="follow_flushes"):
            type(policy).sglang_args(policy.cfg)
