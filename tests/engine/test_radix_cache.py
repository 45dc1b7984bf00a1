"""Radix cache invariants against a brute-force model, under random insert / match / lock / evict sequences."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.engine.radix_cache import RadixCache

keys = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]), keys,
                         st.integers(0, 20)), max_size=40)


def _all_nodes(cache):
    stack, out = [cache.root], []
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _check(cache, freed, allocated):
    nodes = _all_nodes(cache)[1:]
    assert sum(len(n.key) for n in nodes) == cache.total_size()
    assert sum(len(n.key) for n in nodes if n.lock_ref == 0) == cache.evictable_size()
    for n in nodes:
        assert len(n.key) == n.value.shape[0] > 0
        assert n.parent.lock_ref >= n.lock_ref or n.parent is cache.root      # locks cover ancestors
        assert n.parent.children[n.key[0]] is n
    owned = torch.cat([n.value for n in nodes]) if nodes else torch.empty(0, dtype=torch.long)
    assert len(set(owned.tolist())) == owned.numel()                            # no slot owned twice
    assert set(owned.tolist()) | set(freed) == set(range(allocated))            # nothing leaked


@settings(max_examples=150, deadline=None)
@given(ops)
def test_radix_cache_matches_brute_force(operations):
    freed: list[int] = []
    cache = RadixCache(lambda slots: freed.extend(slots.tolist()))
    inserted: set[tuple] = set()
    locks = []
    next_slot = 0
    for op, key, n in operations:
        if op == "insert":
            value = torch.arange(next_slot, next_slot + len(key))
            next_slot += len(key)
            already = cache.insert(key, value)
            freed.extend(value[:already].tolist())                               # duplicates go back
            inserted.add(tuple(key))
        elif op == "match":
            slots, node = cache.match_prefix(key)
            best = max((len(_lcp(key, k)) for k in inserted), default=0)
            assert slots.shape[0] == best
        elif op == "lock":
            _, node = cache.match_prefix(key)
            cache.inc_lock_ref(node)
            locks.append(node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(n % len(locks)))
        elif op == "evict":
            before, total = cache.evictable_size(), cache.total_size()
            got = cache.evict(n)
            assert total - cache.total_size() == got
            assert got >= min(n, before) or cache.evictable_size() == 0
            # eviction only cuts suffixes: each inserted key survives as one of its prefixes
            survivors = {k[:cache.match_prefix(list(k))[0].shape[0]] for k in inserted}
            inserted = {k for k in survivors if k}
        _check(cache, freed, next_slot)
    for node in locks:
        cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and sorted(freed) == list(range(next_slot))


def _lcp(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


def test_match_returns_slots_in_order_and_splits():
    cache = RadixCache(lambda s: None)
    cache.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    slots, node = cache.match_prefix([1, 2, 9])
    assert slots.tolist() == [10, 11] and node.key == [1, 2]
    assert cache.insert([1, 2, 5], torch.tensor([20, 21, 22])) == 2


def test_eviction_is_lru_and_skips_locked():
    freed = []
    cache = RadixCache(lambda s: freed.extend(s.tolist()))
    cache.insert([1, 1], torch.tensor([0, 1]))
    cache.insert([2, 2], torch.tensor([2, 3]))
    cache.insert([3, 3], torch.tensor([4, 5]))
    _, locked = cache.match_prefix([1, 1])        # touched last, and locked
    cache.inc_lock_ref(locked)
    cache.match_prefix([3, 3])
    cache.evict(2)
    assert freed == [2, 3]                         # [2,2] was least recently used
    cache.evict(100)
    assert sorted(freed) == [2, 3, 4, 5] and cache.protected_size() == 2


def test_access_times_follow_sglang():
    """RadixCache._match_prefix_helper / _insert_helper / _split_node: a split's upper node is new (touched now), its
    lower half keeps its old time; an insert that ends exactly at a node leaves that node's time alone; a match
    touches every node it fully walks. Eviction order (LRU leaves) shows it."""
    freed = []
    cache = RadixCache(lambda s: freed.append(s.tolist()))
    cache.insert([1, 2, 3, 4], torch.tensor([0, 1, 2, 3]))
    cache.insert([9, 9], torch.tensor([4, 5]))
    cache.match_prefix([1, 2, 7])                  # splits [1 2 | 3 4]: [3 4] stays older than [9 9]
    cache.insert([5, 5], torch.tensor([6, 7]))
    cache.insert([9, 9], torch.tensor([8, 9]))     # ends exactly at [9 9]: not touched
    cache.evict(1)
    cache.evict(1)
    assert freed == [[2, 3], [4, 5]]
    cache.match_prefix([5, 5])                     # touches [5 5]: [1 2] is now the oldest leaf
    cache.evict(1)
    assert freed[-1] == [0, 1]


def test_lock_deltas_are_evictable_size_changes():
    """inc_lock_ref / dec_lock_ref return the change of the evictable size (PrefillAdder adds it to its budget)."""
    cache = RadixCache(lambda s: None)
    cache.insert([1, 2, 3], torch.tensor([0, 1, 2]))
    _, node = cache.match_prefix([1, 2, 9])
    assert cache.inc_lock_ref(node) == -2 and cache.inc_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 2
    assert cache.evictable_size() == 3
