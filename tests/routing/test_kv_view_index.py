"""The exact view's index (kv_view.py: a match is a binary search while a worker's blocks are prefix-closed) answers
what the walk block by block answers, on random streams of KV events, credits, ends, lapses, flushes and removals --
removals of middle blocks and prefixes removed under requests in flight included, the cases that break closure.

Oracle: the first block each worker misses, found by walking the view's own counts (``holds``; stored and recent
for ``confirmed_prefix``), and the index's gaps and chain starts counted from scratch."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from framework.kv_events.events import AllBlocksCleared
from framework.kv_events.hashing import NATIVE, ROOT_HASH, BlockKeys
from plugins.routing.lib.kv_policy import PromptKeys
from plugins.routing.lib.kv_view import KvView

from kv_view_ops import play, walked

B = 2
WORKERS = "ab"
texts = st.binary(min_size=0, max_size=24).map(lambda s: bytes(97 + c % 2 for c in s))  # two letters: shared prefixes
# each op: (what, worker, which text of the example's few, how many of its bytes, a number for the op)
ops = st.lists(st.tuples(st.sampled_from(["store", "store", "store_tail", "remove", "remove", "clear", "credit",
                                          "credit", "end", "fail", "expire", "forget", "drop"]),
                         st.sampled_from(WORKERS), st.integers(0, 3), st.integers(0, 24), st.integers(0, 11)),
               min_size=5, max_size=50)


def walked_confirmed(view: KvView, keys: list[int], worker: str, upto: int) -> int:
    stored, recent = view._by_events.get(worker, {}), view._recent.get(worker, {})
    n = 0
    while n < upto and (keys[n] in stored or keys[n] in recent):
        n += 1
    return n


def gaps(view: KvView, worker: str, has) -> dict[int, int]:
    """Blocks the worker lacks right above one it has (in ``has``), with their depths, counted from scratch."""
    out = {}
    for key, (parent, depth) in view._parent.items():
        if has(key) and parent != ROOT_HASH and not has(parent):
            out[parent] = depth - 1
    return out


def check(view: KvView, probes: list[bytes], in_flight: list) -> None:
    confirmed = {}  # key -> workers holding it stored or recent
    for w in WORKERS:
        stored, recent = view._by_events.get(w, {}), view._recent.get(w, {})
        assert view._conf_gaps.get(w, {}) == gaps(view, w, lambda k: k in stored or k in recent)
        for k in {*stored, *recent}:
            confirmed[k] = confirmed.get(k, 0) + 1
        starts = {}
        for worker, keys, parent, depth, _ in in_flight:
            if worker == w and keys and depth:
                starts[parent, depth - 1] = starts.get((parent, depth - 1), 0) + 1
        assert {(parent, depth): n for parent, (depth, n) in view._starts.get(w, {}).items()} == starts
        held = view._held.get(w, {})  # the chains' parents the worker lacks, kept as its counts change: from scratch
        assert view._missing.get(w, set()) == {parent for parent, _ in starts if parent not in held}
    for parent, depth in view._parent.values():  # a block's depth: its parent's + 1
        assert parent in view._parent and view._parent[parent][1] == depth - 1 or parent not in view._parent
    assert view._refs == confirmed and set(view._parent) == set(confirmed)
    for text in probes:
        keys = view.keys.chain(text)
        assert all(view._parent[k][1] == i for i, k in enumerate(keys) if k in view._parent)  # its place on the path
        got = view.match(keys, list(WORKERS))
        for w in WORKERS:
            assert got[w] == walked(view, keys, w), (text, w)
            for upto in {got[w], len(keys)}:
                assert view.confirmed_prefix(w, keys, upto) == walked_confirmed(view, keys, w, upto), (text, w, upto)


@pytest.mark.parametrize("native", [pytest.param(False, id="python"), pytest.param(
    True, id="c", marks=pytest.mark.skipif(not NATIVE, reason="the C extension is not built"))])
@settings(max_examples=100, deadline=None)
@given(sequence=ops, probes=st.lists(texts, min_size=4, max_size=4))
def test_the_index_answers_what_the_walk_answers(native, sequence, probes):
    view = KvView(B, confirm_s=1.0, native=native)  # C: the search bounded by the gaps on the path, in C
    now = 0.0
    in_flight = []  # (worker, credited keys, removals at the decision)
    for op, w, which, cut, k in sequence:
        text = probes[which][:cut]
        if op == "expire":
            now += 0.6
            view.expire(now)
        elif op == "forget":
            view.forget(w, capacity=k % 2 == 0)
        elif op == "drop":  # a removed worker: everything of it goes, its requests never end
            view.forget(w, capacity=True)
            view.drop_credits(w)
            in_flight = [f for f in in_flight if f[0] != w]
        else:
            play(view, op, w, text, k, in_flight, now)
        check(view, probes + [text], in_flight)
    for worker, keys, parent, depth, since in in_flight:  # every request ends, every credit lapses: only events' left
        view.retire(worker, keys, parent, depth, now, since)
    view.expire(now + 10)
    check(view, probes, [])
    for w in WORKERS:
        view.apply(w, AllBlocksCleared())
    assert not any(view._held.values()) and view._parent == {} and view._refs == {} and view._conf_gaps == {}
    assert view._starts == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.binary(max_size=20).map(lambda s: bytes(97 + c % 3 for c in s)),
                          st.booleans()), min_size=1, max_size=40))
def test_prompt_keys_reuse_gives_the_keys_of_a_full_hash(turns):
    """Conversations that grow turn by turn (and branch, and repeat a turn): the keys reused from a remembered prompt
    are those a full hash gives, whatever the memo's bounds dropped."""
    keys = BlockKeys(B, native=False)  # the memo serves the Python keys (the C ones hash whole)
    memo = PromptKeys(keys, size=6, per_anchor=2, min_blocks=3)
    history = [b""] * 6
    for conversation, turn, branch in turns:
        text = (history[conversation] if not branch else history[conversation][:len(history[conversation]) // 2]) + turn
        history[conversation] = text
        got = memo.keys(text)
        assert got == keys.chain(text)
        assert memo.continued <= len(got) and got[:memo.continued] == keys.chain(text)[:memo.continued]
    assert len(memo) <= 6
