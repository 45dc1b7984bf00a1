"""prefix_hash (consistent hashing with bounded loads) and power_of_two, against their definitions: a brute-force ring
walk, the load bound at every decision, the share of keys that move when a worker joins, and the same random draws
replayed."""
from __future__ import annotations

import math
import random

from framework.kv_events.hashing import chain_hashes
from framework.core.registry import ROUTING
from framework.contracts.routing import LoadReport, RequestView

PrefixHash, PowerOfTwo = ROUTING.get("prefix_hash"), ROUTING.get("power_of_two")


def prompts(n, seed=0, shared=40):
    rng = random.Random(seed)
    systems = ["".join(rng.choice("abcdefgh") for _ in range(300)) for _ in range(shared)]
    return [rng.choice(systems) + " question %d" % i for i in range(n)]


def brute_force(policy, text, candidates):
    """Walk every ring point in order from the key; first candidate under the bound."""
    loads = policy.loads
    cap = math.ceil(policy.cfg.load_factor * (sum(loads[w] for w in candidates) + 1) / len(candidates))
    tokens = text.encode()
    key = chain_hashes(tokens[:policy.cfg.block_size * policy.cfg.prefix_blocks], policy.cfg.block_size)[-1]
    ring = sorted(policy._ring)
    after = [w for p, w in ring if p > key] + [w for p, w in ring if p <= key]
    order = [w for w in after if w in candidates]
    return next(w for w in order if loads[w] < cap), order[0]


def test_prefix_hash_is_the_bounded_ring_walk():
    policy = PrefixHash(PrefixHash.Config(load_factor=1.25, virtual_nodes=8))
    for i in range(5):
        policy.add_worker(f"w{i}")
    rng = random.Random(1)
    in_flight = []
    for text in prompts(400):
        candidates = sorted(rng.sample(policy.workers, rng.randint(1, 5)))
        expected, home = brute_force(policy, text, candidates)
        assert policy.select(text, workers=candidates) == expected
        assert policy.last_decision.reason == ("hash" if expected == home else "overflow")
        cap = math.ceil(1.25 * (sum(policy.loads[w] for w in candidates)) / len(candidates))
        assert policy.loads[expected] <= cap  # the bound held when it was chosen
        in_flight.append(expected)
        if len(in_flight) > 30:
            policy.on_request_done(in_flight.pop(rng.randrange(len(in_flight))))


def test_prefix_hash_keeps_affinity_and_moves_few_keys_when_a_worker_joins():
    texts = prompts(300, shared=60)
    policy = PrefixHash(PrefixHash.Config(load_factor=100.0))  # loads never bind: pure consistent hashing
    for i in range(4):
        policy.add_worker(f"w{i}")
    before = [policy.select(t) for t in texts]
    assert len(set(before)) == 4
    same_prefix = {}
    for t, w in zip(texts, before):  # the same first blocks, the same worker
        assert same_prefix.setdefault(t[:256], w) == w
    policy.add_worker("w4")
    after = [policy.select(t) for t in texts]
    moved = sum(a != b for a, b in zip(before, after))
    assert all(a == "w4" for a, b in zip(after, before) if a != b)  # keys only move to the new worker
    assert 0.05 < moved / len(texts) < 0.4  # ~1/5 of them


def test_prefix_hash_short_prompts_and_token_ids():
    policy = PrefixHash()
    for w in "ab":
        policy.add_worker(w)
    assert policy.key(RequestView("hi")) == policy.key(RequestView("ignored", token_ids=list(b"hi")))
    assert policy.select("") in "ab"


def test_power_of_two_replays_its_draws():
    policy = PowerOfTwo(seed=7)
    for w in "abcde":
        policy.add_worker(w)
    rng = random.Random(7)
    for i in range(300):
        a, b = rng.sample(list("abcde"), 2)
        expected = a if policy.loads[a] <= policy.loads[b] else b
        assert policy.select("x") == expected
        if i % 3 == 0:
            policy.on_request_done(random.Random(i).choice("abcde"))
    spread = max(policy.loads.values()) - min(policy.loads.values())
    assert spread <= 3  # two choices keep the loads within a few of each other


def test_power_of_two_on_worker_reported_tokens():
    policy = PowerOfTwo(PowerOfTwo.Config(load="worker_tokens"), seed=0)
    assert "load" in policy.subscriptions
    for w in "ab":
        policy.add_worker(w)
    policy.on_worker_event("a", LoadReport(running=1, queued=0, num_tokens=5000))
    policy.on_worker_event("b", LoadReport(running=9, queued=9, num_tokens=10))
    assert all(policy.select("x") == "b" for _ in range(20))  # b's requests hold less KV, whatever the counts
