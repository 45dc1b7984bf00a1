"""The policies on the exact view (precise_prefix, kv_cost) against brute force, and the view against real caches.

Oracles: (1) real RadixCaches, one per worker, whose events (the emitter) feed the policy: the policy's estimate for
a request equals what the chosen worker's cache holds of it, floored to whole blocks (and at most all but the last
token); (2) a plain model of each worker's blocks (the block prefixes it stored, plus the requests in flight there),
from which each rule is recomputed by brute force, decision by decision."""
from __future__ import annotations

import math
import random
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from framework.kv_events.hashing import chain_hashes
from framework.core.registry import ROUTING
from framework.contracts.routing import EVENTS_LOST, RESET_CAUSES, RESTARTED, RequestView

B = 4


def make(key, workers="abc", **cfg):
    cls = ROUTING.get(key)
    policy = cls(cls.Config(block_size=B, **cfg))
    for w in workers:
        policy.add_worker(w)
    return policy


def cached_len(cache: RadixCache, tokens: list[int]) -> int:
    slots, _ = cache.match_prefix(tokens)
    return slots.shape[0]


def test_estimate_is_the_real_cache_floored_to_blocks():
    rng = random.Random(0)
    policy = make("precise_prefix", cache_threshold=0.0, balance_abs_threshold=10**6)
    caches = {}
    for w in "abc":
        caches[w] = RadixCache(lambda s: None)
        caches[w].observer = CacheEventEmitter(B, lambda e, w=w: policy.on_worker_event(w, e))
    prefixes = [bytes(rng.randrange(97, 100) for _ in range(rng.randrange(3, 30))) for _ in range(6)]
    for i in range(300):
        text = (rng.choice(prefixes) + bytes(rng.randrange(97, 100) for _ in range(rng.randrange(0, 12)))).decode()
        tokens = list(text.encode())
        if not tokens:
            continue
        worker = policy.select(text)
        d = policy.last_decision
        held = cached_len(caches[worker], tokens)
        assert d.matched_chars == min(held // B * B, len(tokens) - 1), (i, text, worker)
        assert d.request_chars == len(tokens)
        caches[worker].insert(tokens, torch.arange(len(tokens)))  # the worker served it: its cache holds it now
        policy.on_request_done(worker, d)
        if i % 7 == 0:
            victim = rng.choice("abc")
            caches[victim].evict(rng.randrange(1, 40))


def blocks_of(tokens) -> list[tuple]:
    return [tuple(tokens[:k * B]) for k in range(1, len(tokens) // B + 1)]


class Model:
    """Each worker's blocks (as token prefixes) from events, the requests in flight there, and the blocks of requests
    that ended there whose events have not come yet."""

    def __init__(self, workers):
        self.stored = {w: {} for w in workers}  # worker -> block prefix -> its hash
        self.flight = []  # (worker, tokens, credited block prefixes, prefill tokens, blocks)
        self.recent = {w: [] for w in workers}  # worker -> block prefixes (a list: one entry per ended request)
        self.routed = []  # [tokens, worker, open, the worker's epoch] of every decision, in order
        self.peak = {w: 0 for w in workers}  # the most blocks stored at once
        self.stored_total = {w: 0 for w in workers}  # blocks stored by events since its flush, halved at each turnover
        self.since_aging = 0  # blocks stored by all since the last halving
        self.epoch = {w: 0 for w in workers}  # bumped by a flush: the sessions routed there before lose their affinity

    def holds(self, w, prefix) -> bool:
        return (prefix in self.stored[w] or prefix in self.recent[w]
                or any(f[0] == w and prefix in f[2] for f in self.flight))

    def confirmed(self, w, tokens, upto) -> int:
        return next((k for k, p in enumerate(blocks_of(tokens)[:upto])
                     if p not in self.stored[w] and p not in self.recent[w]), upto)

    def matched(self, w, tokens) -> int:
        k = 0
        for prefix in blocks_of(tokens):
            if not self.holds(w, prefix):
                break
            k += 1
        return k


def est(k, n):
    return min(k * B, max(n - 1, 0))


def precise_rule(cfg, model, loads, tokens, cands):
    n = len(tokens)
    matched = {w: model.matched(w, tokens) for w in cands}
    hi, lo = max(loads[w] for w in cands), min(loads[w] for w in cands)
    if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
        return min(cands, key=loads.get), "balance", matched
    if cfg.session_affinity:  # the latest request not continued yet whose last full block is the deepest of this one
        for prefix in reversed(blocks_of(tokens)):
            went = [r for r in model.routed if r[2] and blocks_of(r[0]) and blocks_of(r[0])[-1] == prefix]
            if went:
                went[-1][2] = False  # continued: it names no worker again
                for r in model.routed:  # nor does any earlier request with that last block (the router keeps one)
                    if r[2] and blocks_of(r[0]) and blocks_of(r[0])[-1] == prefix:
                        r[2] = False
                if went[-1][1] in cands and went[-1][3] == model.epoch[went[-1][1]]:
                    return went[-1][1], "session", matched
                break
    if cfg.load_factor:
        cap = math.ceil(cfg.load_factor * (sum(loads[w] for w in cands) + 1) / len(cands))
        cands = [w for w in cands if loads[w] < cap]
    best = max(matched[w] for w in cands)
    if n and est(best, n) / n > cfg.cache_threshold:
        worker = min((w for w in cands if matched[w] == best), key=loads.get)
        if cfg.spill_factor:
            cap = math.ceil(cfg.spill_factor * (sum(loads[w] for w in cands) / len(cands) + 1))
            under = [w for w in cands if loads[w] < cap]
            hot = sum(1 for f in model.flight if f[0] == worker and blocks_of(f[1])[:1] == blocks_of(tokens)[:1])
            pending = sum(f[3] for f in model.flight if f[0] == worker)
            fits = cfg.spill_pressure and pending <= cfg.spill_pressure * model.peak[worker] * B
            if hot >= cap and under and not fits:
                best = max(matched[w] for w in under)
                return min((w for w in under if matched[w] == best), key=loads.get), "spill", matched
        return worker, "cache_hit", matched
    if cfg.miss_policy == "least_loaded":
        return min(cands, key=loads.get), "cache_miss", matched
    if cfg.miss_policy == "least_prefill":
        def ahead(w):  # the prefill of the requests in flight there, and of this one minus what w holds
            return sum(f[3] for f in model.flight if f[0] == w) - est(matched[w], n), loads[w]
        if cfg.prefill_slack:  # near the least: the cache that stored the fewest blocks
            near = min(ahead(w)[0] for w in cands) + cfg.prefill_slack * n
            return min((w for w in cands if ahead(w)[0] <= near),
                       key=lambda w: (model.stored_total[w], ahead(w))), "cache_miss", matched
        return min(cands, key=ahead), "cache_miss", matched
    return min(cands, key=lambda w: len(model.stored[w])), "cache_miss", matched


def cost_rule(cfg, model, loads, tokens, cands):
    n = len(tokens)
    matched = {w: model.matched(w, tokens) for w in cands}
    def cost(w):
        prefill = sum(f[3] for f in model.flight if f[0] == w)
        active = sum(f[4] for f in model.flight if f[0] == w)
        return cfg.overlap_score_weight * (n - est(matched[w], n) + prefill) / B + active + math.ceil(n / B), active
    worker = min(cands, key=cost)
    return worker, "overlap" if matched[worker] else "no_overlap", matched


steps = st.lists(st.one_of(
    st.tuples(st.just("select"), st.lists(st.integers(0, 1), max_size=14), st.sampled_from([None, "ab", "bc"])),
    st.tuples(st.just("done"), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("store"), st.lists(st.integers(0, 1), min_size=B, max_size=14), st.sampled_from("abc")),
    st.tuples(st.just("evict"), st.integers(0, 50), st.sampled_from("abc")),
    st.tuples(st.just("clear"), st.just(None), st.sampled_from("abc")),
), min_size=5, max_size=50)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["precise_prefix", "kv_cost"]), st.sampled_from([0.0, 0.3, 0.9]), st.sampled_from([0, 2, 99]),
       st.sampled_from(["least_loaded", "smallest_cache", "least_prefill"]), steps)
def test_decisions_match_brute_force(key, threshold, gap, miss, sequence):
    if key == "precise_prefix":
        policy = make(key, cache_threshold=threshold, balance_abs_threshold=gap, miss_policy=miss,
                      load_factor=0.0 if gap else 1.25)
        rule = precise_rule
    else:
        policy = make(key, overlap_score_weight=threshold * 3)
        rule = cost_rule
    play(policy, rule, sequence)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([0.0, 0.3]), st.sampled_from([0, 99]), st.sampled_from([0.0, 1.0, 1.5]),
       st.sampled_from([0.0, 0.5]), st.booleans(), st.sampled_from([0.0, 0.25, 2.0]), steps)
def test_session_affinity_and_spill_match_brute_force(threshold, gap, spill, pressure, affinity, slack, sequence):
    """precise_prefix's servelab rules (router=sticky_prefix): the latest request not yet continued whose last block
    leads this one names its worker; a hot first block spills past the cap (with ``spill_pressure``, only while the
    worker's in-flight prefill exceeds that share of its peak cache); a miss within ``prefill_slack`` x its prompt of
    the least prefill goes to the cache that stored the fewest blocks. Recomputed from every decision so far."""
    policy = make("precise_prefix", cache_threshold=threshold, balance_abs_threshold=gap, session_affinity=affinity,
                  spill_factor=spill, spill_pressure=pressure, miss_policy="least_prefill", prefill_slack=slack)
    play(policy, precise_rule, sequence)


def play(policy, rule, sequence):
    """Drive ``policy`` and the brute-force ``rule`` (on a ``Model``) through ``sequence``, decision by decision."""
    model = Model("abc")
    decisions = []
    for op, arg, extra in sequence:
        if op == "select":
            tokens = [97 + t for t in arg]
            text = bytes(tokens).decode()
            cands = sorted(extra) if extra else list("abc")
            worker, reason, matched = rule(policy.cfg, model, policy.loads, tokens, cands)
            assert policy.select(text, workers=extra and sorted(extra)) == worker
            d = policy.last_decision
            assert (d.reason, d.matched_chars) == (reason, est(matched[worker], len(arg)))
            confirmed = model.confirmed(worker, tokens, matched[worker])  # without the in-flight credits
            assert d.memo.confirmed_tokens == est(confirmed, len(arg))
            credited = set(blocks_of(tokens)[matched[worker]:])
            flight = (worker, tokens, credited, len(arg) - est(matched[worker], len(arg)), math.ceil(len(arg) / B),
                      set())  # the last: its credited blocks the worker stored and removed while it was in flight
            model.flight.append(flight)
            model.routed.append([tokens, worker, True, model.epoch[worker]])  # True: not continued yet
            decisions.append((d, flight))
        elif op == "done" and decisions:  # a request ends (served or failed): its credit and load go
            d, flight = decisions.pop(arg % len(decisions))
            model.flight.remove(flight)
            if extra:  # served: its blocks stay credited until the worker's event for each comes
                model.recent[d.worker] += [p for p in flight[2] if p not in model.stored[d.worker].keys() | flight[5]]
            policy.on_request_done(d.worker, d, ok=extra)
        elif op == "store":  # the worker's cache stored these blocks (chained on what it already had)
            tokens = [97 + t for t in arg]
            have = 0
            while have < len(tokens) // B and tuple(tokens[:(have + 1) * B]) in model.stored[extra]:
                have += 1
            hashes = chain_hashes(tokens, B)
            if have < len(hashes):
                policy.on_worker_event(extra, BlockStored(tuple(hashes[have:]), hashes[have - 1] if have else None,
                                                          tuple(tokens[have * B:len(hashes) * B]), B))
                model.stored_total[extra] += len(hashes) - have
                for k in range(have, len(hashes)):
                    prefix = tuple(tokens[:(k + 1) * B])
                    model.stored[extra][prefix] = hashes[k]
                    if prefix in model.recent[extra]:  # the event an ended request waited for
                        model.recent[extra].remove(prefix)
                model.peak[extra] = max(model.peak[extra], len(model.stored[extra]))
                model.since_aging += len(hashes) - have
                if model.since_aging >= sum(model.peak.values()):  # the caches turned over: the counts halve
                    model.since_aging = 0
                    model.stored_total = {w: n / 2 for w, n in model.stored_total.items()}
        elif op == "evict" and model.stored[extra]:  # one block and every block after it
            prefixes = sorted(model.stored[extra])
            gone = prefixes[arg % len(prefixes)]
            dropped = [p for p in prefixes if p[:len(gone)] == gone]
            policy.on_worker_event(extra, BlockRemoved(tuple(model.stored[extra].pop(p) for p in dropped)))
            for f in model.flight:  # gone: not to be awaited when the request ends
                if f[0] == extra:
                    f[5].update(p for p in dropped if p in f[2])
        elif op == "clear":
            policy.on_worker_event(extra, AllBlocksCleared())
            model.stored[extra].clear()
            model.recent[extra].clear()
            model.stored_total[extra] = 0  # an empty cache: its turnover starts over, and the aging's count
            model.since_aging = 0
            model.peak[extra] = 0  # its size is learnt again
            model.epoch[extra] += 1


def test_block_size_mismatch_names_both_sizes():
    policy = make("precise_prefix")
    with pytest.raises(ValueError, match="blocks of 16 tokens; this policy's router.block_size is 4"):
        policy.on_worker_event("a", BlockStored((1,), None, tuple(range(16)), 16))


def test_pending_credit_keeps_a_new_prefix_together_until_its_events_arrive():
    with_credit, without = make("precise_prefix"), make("precise_prefix", pending_credit=False)
    for policy, together in ((with_credit, True), (without, False)):
        first = policy.select("a brand new system prompt, then question 1")
        second = policy.select("a brand new system prompt, then question 2")
        assert (first == second) is together
        policy.on_request_done(first, policy.last_decision)


def test_recent_credits_wait_for_their_event_or_lapse():
    policy = make("precise_prefix", confirm_s=2.0)
    now = [0.0]
    policy.clock = lambda: now[0]
    text = "a brand new prefix of 32 tokens, then more"
    w = policy.select(text)
    policy.on_request_done(w, policy.last_decision)  # ended: no event yet, its blocks are still counted
    assert policy.select(text) == w and policy.last_decision.matched_chars == len(text) // B * B
    policy.on_request_done(w, policy.last_decision)
    now[0] = 5.0
    policy.maintain(now[0])  # no event within confirm_s: the credits lapse
    assert not any(policy.view._held.values()) and policy.view.stats["lapsed"] > 0


def test_a_block_stored_and_removed_while_its_request_was_in_flight_is_not_awaited():
    """Its events came already: crediting it as "recent" for confirm_s would over-estimate the next request."""
    policy = make("precise_prefix", confirm_s=2.0)
    text = "a prompt of some blocks, stored then evicted"
    tokens = list(text.encode())
    hashes = chain_hashes(tokens, B)
    w = policy.select(text)
    d = policy.last_decision
    policy.on_worker_event(w, BlockStored(tuple(hashes), None, tuple(tokens[:len(hashes) * B]), B))
    policy.on_worker_event(w, BlockRemoved(tuple(hashes[1:])))  # the cache evicted all but the first block
    policy.on_request_done(w, d)
    policy.select(text)
    assert policy.last_decision.worker == w and policy.last_decision.matched_chars == B


def test_removed_worker_leaves_no_credit_behind():
    policy = make("kv_cost")
    w = policy.select("some prompt text")
    policy.on_request_done(w, policy.last_decision)
    w = policy.select("some other prompt text")
    policy.remove_worker(w)
    assert w not in policy.view._held and w not in policy.view._starts
    assert w not in policy.active_blocks


def test_kv_cost_temperature_spreads_and_zero_does_not():
    def picks(temperature):
        policy = make("kv_cost", workers="abcd", temperature=temperature)
        out = []
        for i in range(200):
            out.append(policy.select(RequestView("x", token_ids=[1] * 64)))
            policy.on_request_done(out[-1], policy.last_decision)
        return out
    assert len(set(picks(0.0))) == 1  # equal costs: always the first added
    spread = picks(1.0)
    assert all(spread.count(w) > 20 for w in "abcd")


def test_session_affinity_keeps_a_conversation_whose_history_was_evicted():
    """Without it the next turn goes wherever the view says most is left; with it, back to the session's worker. The
    view holds nothing of the first turn here (no credits, no events: as if its blocks were evicted)."""
    for affinity, back in ((False, False), (True, True)):
        policy = make("precise_prefix", cache_threshold=0.3, session_affinity=affinity, pending_credit=False)
        turn1 = "a conversation's first turn, long enough for blocks"
        w = policy.select(turn1)
        policy.on_request_done(w, policy.last_decision)
        turn2 = turn1 + " and the answer, then the second turn"
        other = policy.select("someone else's request entirely")  # lands on w: the least loaded is now another
        assert (policy.select(turn2) == w) is back, (affinity, w, other)
        assert policy.last_decision.reason == ("session" if back else "cache_miss")


@pytest.mark.parametrize("cause", ["flush_event", *RESET_CAUSES, "removed", "expired"])
def test_session_affinity_ends_with_the_cache_it_protected(cause):
    """A flush (its event, or the router's reset), a restart, a lost stream, the worker's removal, or the session's
    lifetime (affinity_ttl_s) passing: the next turn is routed on the view like a new request."""
    now = [0.0]
    policy = make("precise_prefix", cache_threshold=0.3, session_affinity=True, pending_credit=False,
                  affinity_ttl_s=60.0)
    policy.clock = lambda: now[0]
    turn1 = "a conversation's first turn, long enough for blocks"
    w = policy.select(turn1)
    policy.on_request_done(w, policy.last_decision)
    assert policy.state_sizes()["sessions"] == 1
    if cause == "flush_event":
        policy.on_worker_event(w, AllBlocksCleared())
    elif cause == "removed":
        policy.remove_worker(w)
        policy.add_worker(w)  # the same URL again: a new worker
    elif cause == "expired":
        now[0] = 61.0
        policy.maintain()
        assert policy.state_sizes()["sessions"] == 0  # dropped by maintain, not only ignored
    else:
        policy.reset_worker(w, cause)
    policy.select("someone else's request entirely")
    policy.select(turn1 + " and the answer, then the second turn")
    assert policy.last_decision.reason == "cache_miss"


def test_a_flush_or_a_restart_starts_the_turnover_and_the_capacity_over():
    policy = make("precise_prefix", workers="ab")
    tokens = list(range(1, 65))
    hashes = chain_hashes(tokens, B)
    for w in "ab":
        policy.on_worker_event(w, BlockStored(tuple(hashes), None, tuple(tokens), B))
    view = policy.view
    assert view.capacity_blocks("a") == len(hashes) and view.stored_total("a") > 0
    policy.reset_worker("b", EVENTS_LOST)  # the same cache, some events missed: its size stands
    assert view.stored_total("b") == 0 and view.capacity_blocks("b") == len(hashes)
    policy.on_worker_event("a", AllBlocksCleared())
    assert view.stored_total("a") == 0 and view.capacity_blocks("a") == 0  # learnt again as it fills
    policy.reset_worker("b", RESTARTED)
    assert view.capacity_blocks("b") == 0
    with pytest.raises(ValueError, match="reset cause 'rebooted' is not one of"):
        policy.reset_worker("a", "rebooted")


def test_spill_factor_moves_only_the_hot_prefix():
    """6 requests behind one shared prefix on 4 idle workers: with spill_factor=0 they all queue on the first worker;
    with 1, the third finds 2 in flight there with that prefix, at the cap ceil(1 x (2 / 4 + 1)) = 2, and spills."""
    tools = "the long shared tool prefix of a popular agent. " * 2
    for spill, workers_used in ((0.0, 1), (1.0, 3)):
        policy = make("precise_prefix", workers="abcd", cache_threshold=0.3, spill_factor=spill)
        picks = [(policy.select(tools + f"task {i}"), policy.last_decision.reason) for i in range(6)]
        assert len({w for w, _ in picks}) == workers_used, picks
        if spill:
            assert picks[2][1] == "spill" and picks[2][0] != picks[0][0]
        cold = policy.select("a cold prefix nobody else sends, with its task")
        assert policy.last_decision.reason == "cache_miss"  # a prefix nobody holds is not spilled: least loaded
        assert policy.loads[cold] == 1


def test_spill_pressure_keeps_a_shared_prefix_whose_requests_fit_the_cache():
    """The same 6 requests with spill_factor=1: a worker whose cache (16 blocks, seen in its events) holds what its
    requests in flight bring keeps them all (spill_pressure=1); one whose cache is smaller than that spills."""
    tools = "the long shared tool prefix of a popular agent. " * 2
    for cache_blocks, workers_used in ((64, 1), (4, 3)):
        policy = make("precise_prefix", workers="abcd", cache_threshold=0.3, spill_factor=1.0, spill_pressure=1.0)
        filler = list(range(cache_blocks * B))  # the cache, once full: its peak is what the rule compares against
        policy.on_worker_event("a", BlockStored(tuple(chain_hashes(filler, B)), None, tuple(filler), B))
        policy.on_worker_event("a", BlockRemoved(tuple(chain_hashes(filler, B))))
        picks = {policy.select(tools + f"task {i}") for i in range(6)}
        assert len(picks) == workers_used, (cache_blocks, picks)


def test_prefill_slack_sends_a_miss_to_the_cache_that_stored_least_within_the_slack():
    """Worker a's cache has stored 3 blocks, b's 1: a miss goes to b while b's prefill queued is within slack x the
    miss's prompt of the least; without slack, to the least prefill (a, first added, on a tie)."""
    def cluster(slack):
        policy = make("precise_prefix", "ab", miss_policy="least_prefill", prefill_slack=slack)
        for w, n in (("a", 3), ("b", 1)):
            filler = [200 + ord(w)] * (n * B)
            policy.on_worker_event(w, BlockStored(tuple(chain_hashes(filler, B)), None, tuple(filler), B))
        return policy
    assert cluster(0.0).select("q" * 8) == "a"
    policy = cluster(0.5)
    assert policy.select("q" * 8) == "b"   # nothing queued anywhere: the cache that stored less
    assert policy.select("m" * 16) == "b"  # b has 8 tokens queued: within 0.5 x 16 of a's 0
    assert policy.select("x" * 20) == "a"  # b has 24: past 0.5 x 20


@pytest.mark.parametrize("bad, named", [({"spill_factor": 0.5}, "spill_factor=0.5 must be 0 (off) or >= 1"),
                                        ({"spill_pressure": -1}, "spill_pressure=-1 must be >= 0"),
                                        ({"affinity_size": 0}, "affinity_size=0 must be >= 1"),
                                        ({"miss_policy": "nearest"}, "'least_prefill'"),
                                        ({"prefill_slack": -1}, "prefill_slack=-1 must be >= 0"),
                                        ({"prefill_slack": 0.25}, "widens miss_policy='least_prefill' only; "
                                                                  "miss_policy is 'least_loaded'")])
def test_bad_sticky_settings_are_named(bad, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        make("precise_prefix", **bad)


def test_hold_waits_for_a_prefix_in_flight_until_its_events_or_the_hold_ends():
    now = [0.0]
    for hold in (0.0, 1.0):
        policy = make("precise_prefix", cache_threshold=0.3, hold_s=hold)
        policy.clock = lambda: now[0]
        prefix = "a long prefix that both requests share, " * 2
        a = policy.select(prefix + "first")
        assert policy.hold_s(policy.last_decision) == 0  # nothing of it is anywhere: nothing to wait for
        assert policy.select(prefix + "second") == a
        second = policy.last_decision
        assert policy.hold_s(second) == hold  # its prefix is the first's, still being prefilled
        if hold:
            tokens = list((prefix + "first").encode())
            hashes = chain_hashes(tokens, B)
            policy.on_worker_event(a, BlockStored(tuple(hashes[:3]), None, tuple(tokens[:3 * B]), B))
            assert policy.hold_s(second) == hold  # a part stored: still waiting
            rest = tuple(tokens[3 * B:len(hashes) * B])
            policy.on_worker_event(a, BlockStored(tuple(hashes[3:]), hashes[2], rest, B))
            assert policy.hold_s(second) == 0  # the whole prefix is stored
            policy.select("another prefix, never seen: " * 3)
            policy.select("another prefix, never seen: " * 3 + "again")
            now[0] += 1.5
            assert policy.hold_s(policy.last_decision) == 0  # the hold ran out


def test_a_hold_ends_when_the_request_bringing_its_prefix_fails():
    policy = make("precise_prefix", cache_threshold=0.3, hold_s=5.0)
    prefix = "a long prefix that both requests share, " * 2
    a = policy.select(prefix + "first")
    first = policy.last_decision
    policy.select(prefix + "second")
    second = policy.last_decision
    assert policy.hold_s(second) > 0
    policy.on_request_done(a, first, ok=False)  # nothing is prefilling the prefix there any more
    assert policy.hold_s(second) == 0
