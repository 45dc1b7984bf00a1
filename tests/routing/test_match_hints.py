"""Hints only save probes (issue 25, item 4): ``KvView.match`` answers the same with any guesses (the continued prompt's
length, the match noted for that prompt, the previous candidate's answer) as with none, and as the walk block by block;
and a policy routes a trace the same with its prompt memo and match hints as with every request hashed from scratch and
searched unhinted; the C keys and search (framework/kv_events/native_keys.c) answer and route the same as the Python ones.

Oracles: the walk over the view's own counts (``holds``), and the same policy with the shortcuts turned off, on a
multi-turn trace through real RadixCaches whose KV events reach the policy (evictions past a small cache, a flush of
one worker mid-trace, a failed request)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestUsage
from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.hashing import NATIVE
from plugins.routing.lib.kv_policy import PromptKeys
from plugins.routing.lib.kv_view import KvView

from kv_view_ops import play, walked

B = 2
WORKERS = ["a", "b", "c"]
texts = st.binary(min_size=0, max_size=20).map(lambda s: bytes(97 + c % 2 for c in s))
ops = st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear", "credit", "credit", "end", "fail"]),
                         st.sampled_from(WORKERS), st.integers(0, 3), st.integers(0, 20), st.integers(0, 9)),
               min_size=3, max_size=40)
guesses = st.one_of(st.none(), st.integers(0, 12))
needs_c = pytest.mark.skipif(not NATIVE, reason="the C extension is not built (tests/kv_events/test_block_keys.py says why)")
KEYS = [pytest.param(False, id="python"), pytest.param(True, id="c", marks=needs_c)]


@pytest.mark.parametrize("native", KEYS)
@settings(max_examples=80, deadline=None)
@given(sequence=ops, probes=st.lists(texts, min_size=4, max_size=4), hint=guesses,
       hints=st.dictionaries(st.sampled_from(WORKERS), guesses))
def test_any_hints_give_the_walk_answer(native, sequence, probes, hint, hints):
    view = KvView(B, confirm_s=1.0, native=native)
    in_flight = []
    for op, w, which, cut, k in sequence:
        text = probes[which][:cut]
        play(view, op, w, text, k, in_flight, 0.0)
        for w2 in WORKERS:  # the chains' parents with their depths, and those the worker lacks: counted from scratch
            parents = {}
            for worker, keys, parent, depth, _ in in_flight:
                if worker == w2 and keys and depth:
                    parents[parent] = [depth - 1, parents.get(parent, [0, 0])[1] + 1]
            assert view._starts.get(w2, {}) == parents
            held = view._held.get(w2, {})
            assert view._missing.get(w2, set()) == {p for p in parents if p not in held}
        for probe in probes + [text]:
            keys = view.keys.chain(probe)
            plain = view.match(keys, WORKERS)
            assert view.match(keys, WORKERS, hint, hints) == plain
            assert plain == {w2: walked(view, keys, w2) for w2 in WORKERS}


def turn_trace(seed: int, sessions: int = 12, turns: int = 5) -> list[tuple[int, str]]:
    """(session, prompt) in arrival order: sessions behind 3 shared prefixes, each turn the whole session so far."""
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcd ") for _ in range(64)) for _ in range(3)]
    history = [rng.choice(prefixes) for _ in range(sessions)]
    left, out = [turns] * sessions, []
    while any(left):
        s = rng.choice([i for i in range(sessions) if left[i]])
        prompt = history[s] + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 40)))
        out.append((s, prompt))
        history[s] = prompt + "".join(rng.choice("xyz ") for _ in range(rng.randint(0, 12)))
        left[s] -= 1
    return out


def route(name: str, cfg: dict, trace: list[tuple[int, str]], shortcuts: bool, native: bool = False) -> list[tuple]:
    """Each decision (worker, reason, estimate, memo less its hold deadline) over ``trace``: 6 in flight, each worker a
    RadixCache of 600 tokens (evicting), worker "w1" flushed half-way, every 17th request failed. ``native``: the C
    keys and search, else the Python ones."""
    policy = ROUTING.build(name, ROUTING.get(name).Config(**cfg))
    policy.view = KvView(B, policy.cfg.confirm_s, native=native)
    policy.prompts = None if native else PromptKeys(policy.view.keys)  # as KvViewPolicy sets it
    if not shortcuts:  # every request hashed from scratch, every search unhinted
        policy.prompts = PromptKeys(policy.view.keys, min_blocks=1 << 30)
    caches, out, flight = {}, [], []
    for w in ("w0", "w1", "w2"):
        policy.add_worker(w)
        caches[w] = RadixCache(lambda slots: None)
        caches[w].observer = CacheEventEmitter(B, lambda e, w=w: policy.on_worker_event(w, e))
    for i, (_, prompt) in enumerate(trace):
        worker = policy.select(prompt)
        d = policy.last_decision
        out.append((d.worker, d.reason, d.matched_chars, d.memo._replace(hold_until=0.0)))
        flight.append((worker, d, prompt, i % 17 == 16))
        if i == len(trace) // 2:
            caches["w1"].reset()
        if len(flight) > 6:
            done, decision, text, failed = flight.pop(0)
            if not failed:
                tokens = list(text.encode())
                caches[done].insert(tokens, torch.arange(len(tokens), dtype=torch.int32))
                over = caches[done].total_size() - 600
                if over > 0:
                    caches[done].evict(over)
            policy.on_request_done(done, decision, not failed, None if failed else RequestUsage(len(text), 0, 4))
    return out


STICKY = dict(cache_threshold=0.3, miss_policy="least_prefill", prefill_slack=0.25, session_affinity=True,
              spill_factor=1.5, spill_pressure=1.0)


def test_memo_and_hints_do_not_change_a_decision():
    trace = turn_trace(seed=3)
    for name, cfg in (("precise_prefix", {}), ("precise_prefix", STICKY), ("kv_cost", {})):
        cfg = dict(cfg, block_size=B)
        fast, plain = route(name, cfg, trace, True), route(name, cfg, trace, False)
        assert fast == plain, name
        assert len({d[0] for d in fast}) > 1 and any(d[2] for d in fast)  # it routed, and found cached prefixes


def keyless(decision: tuple) -> tuple:
    """A decision without the key values (the C and the Python keys differ; how many there are does not)."""
    worker, reason, estimate, memo = decision
    return (worker, reason, estimate, len(memo.keys), memo.prefill_tokens, memo.blocks, memo.confirmed_tokens,
            memo.first_block is None, memo.since, len(memo.hold), memo.parent == 0, memo.depth)


@needs_c
def test_the_c_keys_and_search_route_as_the_python_ones():
    trace = turn_trace(seed=5)
    for name, cfg in (("precise_prefix", {}), ("precise_prefix", STICKY), ("kv_cost", {})):
        cfg = dict(cfg, block_size=B)
        c, python = route(name, cfg, trace, True, native=True), route(name, cfg, trace, True)
        assert list(map(keyless, c)) == list(map(keyless, python)), name
        assert len({d[0] for d in c}) > 1 and any(d[2] for d in c)
