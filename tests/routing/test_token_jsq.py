"""Splitwise's routers (plugins/routing/token_jsq.py, mixed_pool.py) on hand-built cases: each expected figure is
splitwise-sim's rule applied by hand (scheduler.py TokenJSQScheduler / MixedPoolScheduler, task.py's releases)."""
from __future__ import annotations

import pytest

from framework.contracts.routing import RequestView, wants_first_token
from framework.core.registry import ROUTING

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _policy(key, workers=(A, B, C), **cfg):
    cls = ROUTING.get(key)
    policy = cls(cls.Config(**cfg))
    for w in workers:
        policy.add_worker(w)
    return policy


def _req(prompt: int, output: int | None = None) -> RequestView:
    return RequestView("x" * prompt, list(range(prompt)), output)


def test_token_jsq_counts_prompt_plus_one_releases_the_prompt_at_the_first_token_and_the_one_at_the_end():
    p = _policy("token_jsq")
    picks = []
    for n in (100, 50, 10, 5):
        picks.append((p.select(_req(n)), p.last_decision))
    # all at 0: the first added; then the fewest pending (A 101, B 51, C 11 -> C)
    assert [w for w, _ in picks] == [A, B, C, C]
    assert p.pending == {A: 101, B: 51, C: 11 + 6}
    w, d = picks[0]
    p.on_first_token(w, d)
    assert p.pending[A] == 1                      # task.py:138: the prompt's tokens leave at its first token
    p.on_first_token(w, d)                        # told twice: counted once
    assert p.pending[A] == 1
    assert p.select(_req(7)) == A                 # 1 < 17 < 51
    assert p.pending[A] == 1 + 8
    p.on_request_done(w, d)                       # task.py:206: the one leaves at the end
    assert p.pending[A] == 8
    w2, d2 = picks[1]
    p.on_request_done(w2, d2, ok=False)           # never told of a first token: all of it leaves at the end
    assert p.pending[B] == 0
    assert p.last_decision.reason == "least_pending_tokens" and p.last_decision.request_chars == 7


def test_token_jsq_ties_go_to_the_first_added_among_the_candidates():
    p = _policy("token_jsq")
    p.select(_req(3), [A])
    assert p.select(_req(3), [C, B]) == B         # B and C both at 0: B was added first
    assert p.select(_req(3)) == C
    assert p.select(_req(3)) == A                 # A, B, C all at 4


def test_token_jsq_without_token_ids_counts_utf8_bytes():
    p = _policy("token_jsq", workers=(A,))
    p.select("héllo")
    assert p.pending[A] == 6 + 1


def test_state_follows_the_workers_and_a_removed_worker_s_late_token_is_ignored():
    p = _policy("token_jsq")
    p.select(_req(40))
    d = p.last_decision
    p.remove_worker(A)
    assert A not in p.pending and p.state_sizes() == {"pending_workers": 2}
    p.on_first_token(A, d)                        # it left: nothing to release, no error
    p.on_request_done(A, d)
    p.add_worker(A)                               # a re-added URL starts afresh
    assert p.pending[A] == 0
    assert p.select(_req(9)) == B
    p.reset_worker(B)                             # a restart does not void the requests in flight: they end later
    assert p.pending[B] == 10
    m = _policy("mixed_pool")
    m.role = "decode"
    m.select(_req(10, 20), [A, B])
    m.remove_worker(A)
    assert A not in m.reserved and m.state_sizes() == {"pending_workers": 2, "reserved_workers": 2}


def test_the_first_token_hook_is_wanted_only_by_the_policies_that_override_it():
    wanting = {key for key in ROUTING.keys() if wants_first_token(ROUTING.get(key)(ROUTING.get(key).Config()))}
    assert wanting == {"token_jsq", "mixed_pool"}


def test_mixed_pool_pairs_the_fewest_pending_prompt_tokens_with_the_least_reserved_memory():
    p = _policy("mixed_pool", workers=(A, B, C, "http://d:1"))
    prefill, decode = [A, B], [C, "http://d:1"]
    D = "http://d:1"
    assert p.select_pair(_req(100, 400), prefill, decode) == (A, C)   # ties: the first added on each side
    pd, dd = p.last_pair
    assert (pd.reason, dd.reason) == ("least_pending_prompt", "least_memory")
    assert p.pending[A] == 100 and p.pending[C] == 0        # scheduler.py:734: the prompt machine gets prompt_size
    assert p.reserved[C] == 100 + 400     # scheduler.py:723-724: kv(prompt + 1) + kv(token_size = output - 1)
    assert p.select_pair(_req(10, 5), prefill, decode) == (B, D)
    assert p.reserved[D] == 15
    assert p.select_pair(_req(20, 1000), prefill, decode) == (B, D)   # B 10 < A 100; D 15 < C 500
    assert p.pending[B] == 30 and p.reserved[D] == 15 + 1020
    p.on_first_token(A, pd)                                 # the first request's prompt phase ended on A
    assert p.pending[A] == 0 and p.reserved[C] == 500       # its token machine's memory stays until the end
    p.on_request_done(A, pd)
    p.on_request_done(C, dd)
    assert p.pending[A] == 0 and p.reserved[C] == 0
    assert p.select_pair(_req(1, 1), prefill, decode) == (A, C)


def test_mixed_pool_says_where_splitwise_would_lend_a_machine():
    p = _policy("mixed_pool", workers=(A, B), prompt_max_pending_batch_tokens=100, kv_capacity_tokens=50.5)
    p.select_pair(_req(100, 10), [A], [B])                  # an empty prompt machine: no queue, not long
    assert [d.reason for d in p.last_pair] == ["least_pending_prompt", "token_memory_full"]   # 0 + 110 >= 50.5
    assert p.reserved[B] == 110
    p2 = _policy("mixed_pool", workers=(A, B), prompt_max_pending_batch_tokens=100, kv_capacity_tokens=50.5)
    p2.select_pair(_req(60, 10), [A], [B])                  # B: 0 + 70 >= 50.5: full (is_memory_loaded's >=)
    assert [d.reason for d in p2.last_pair] == ["least_pending_prompt", "token_memory_full"]
    p2.select_pair(_req(40, 0), [A], [B])                   # A: 60 + 40 = 100, not above 100
    assert p2.last_pair[0].reason == "least_pending_prompt"
    p2.select_pair(_req(1, 0), [A], [B])                    # A: 100 + 1 > 100 with a prompt pending
    assert p2.last_pair[0].reason == "prompt_queue_long"
    p3 = _policy("mixed_pool", workers=(A, B), kv_capacity_tokens=11.0)
    p3.select_pair(_req(5, 5), [A], [B])                    # 5 + 5 = 10 < 11
    assert p3.last_pair[1].reason == "least_memory"
    p3.select_pair(_req(0, 0), [A], [B])                    # 10 + 1 (at least the first token's KV) >= 11
    assert p3.last_pair[1].reason == "token_memory_full"


def test_mixed_pool_without_a_role_falls_back_to_mixed_batching_as_token_jsq():
    m, t = _policy("mixed_pool"), _policy("token_jsq")
    for n in (30, 5, 8, 1, 60):
        assert m.select(_req(n)) == t.select(_req(n))
        assert m.last_decision.reason == "mixed_batching"
    assert m.pending == t.pending and set(m.reserved.values()) == {0}


def test_mixed_pool_refuses_negative_thresholds():
    with pytest.raises(ValueError, match="must be >= 0"):
        _policy("mixed_pool", kv_capacity_tokens=-1.0)
