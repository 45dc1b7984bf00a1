"""The cache-aware router's radix tree against a brute-force model (the list of texts sent to each tenant).

What is checked, precisely, after every operation of a random sequence (small alphabet, so prefixes collide):
- ``match(q)[0]`` == max over every text still held by any tenant of len(common prefix(q, text)) (0 when none);
- ``match(q)[1]`` keys == the tenants having a text with that longest common prefix (empty when it is 0);
- ``insert`` returns the longest common prefix of the text with the tenant's own earlier texts;
- ``tenant_size(t)`` == the number of distinct non-empty prefixes of t's texts (a character trie's node count);
- structure: children keyed by their first character, no empty non-root edge, ``end`` = depth in characters, every
  non-root node has a tenant, a tenant on a node is on its parent, and node_count / total_chars match a walk.
Eviction is checked against a reference that repeatedly removes the tenant's oldest leaf (the tenant's nodes and
stamps are read from the tree before eviction; the reference then evicts by a plain min scan).
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from plugins.routing.lib.radix_tree import RadixTree


def lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def distinct_prefixes(texts) -> set[str]:
    return {s[:i] for s in texts for i in range(1, len(s) + 1)}


def walk_nodes(tree: RadixTree):
    """(full text from the root, node) for every non-root node."""
    stack = [("", tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            stack.append((prefix + child.text, child))
            yield prefix + child.text, child


def check_structure(tree: RadixTree) -> None:
    count = chars = 0
    sizes: dict[str, int] = {}
    for path, node in walk_nodes(tree):
        count += 1
        chars += len(node.text)
        assert node.text, f"empty edge at {path!r}"
        assert node.parent.children[node.text[0]] is node, f"child of {path!r} not keyed by its first character"
        assert node.end == len(path), f"end {node.end} != depth {len(path)} at {path!r}"
        assert node.tenants, f"node {path!r} has no tenant"
        if node.parent is not tree.root:
            missing = set(node.tenants) - set(node.parent.tenants)
            assert not missing, f"tenants {missing} on {path!r} but not on its parent"
        for t in node.tenants:
            sizes[t] = sizes.get(t, 0) + len(node.text)
    assert (tree.node_count, tree.total_chars) == (count, chars)
    for t in set(sizes) | set(tree.tenants()):
        assert tree.tenant_size(t) == sizes.get(t, 0), f"tenant {t}: kept size {tree.tenant_size(t)} != walk"


def check_against_model(tree: RadixTree, model: dict[str, list[str]], queries) -> None:
    every = [(t, s) for t, texts in model.items() for s in texts]
    for q in queries:
        best = max((lcp(q, s) for _, s in every), default=0)
        holders = {t for t, s in every if lcp(q, s) == best} if best else set()
        matched, tenants, _ = tree.match(q)
        assert matched == best, f"match({q!r}) = {matched}, brute force {best}"
        assert set(tenants) == holders, f"match({q!r}) tenants {set(tenants)}, brute force {holders}"
    for t, texts in model.items():
        assert tree.tenant_size(t) == len(distinct_prefixes(texts)), f"tenant {t} size"
    assert tree.total_chars == len(distinct_prefixes(s for _, s in every))


texts = st.text(alphabet="abc", max_size=9)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), texts, st.sampled_from("xyz")),
    st.tuples(st.just("remove"), st.just(""), st.sampled_from("xyz")),
), min_size=5, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(texts, max_size=8))
def test_tree_matches_brute_force(sequence, extra_queries):
    tree, model, clock = RadixTree(), {}, itertools.count(1)
    for op, text, tenant in sequence:
        if op == "insert":
            expected_held = max((lcp(text, s) for s in model.get(tenant, [])), default=0)
            assert tree.insert(text, tenant, next(clock)) == expected_held
            model.setdefault(tenant, []).append(text)
        else:
            tree.remove_tenant(tenant)
            model.pop(tenant, None)
        check_structure(tree)
        inserted = [s for v in model.values() for s in v]
        queries = inserted + [s + "a" for s in inserted] + [s[:-1] for s in inserted] + extra_queries
        check_against_model(tree, model, queries)


def tenant_view(tree: RadixTree, tenant: str) -> dict[str, tuple[int, float, str]]:
    """full path -> (edge length, stamp, parent's full path) of the nodes holding ``tenant``."""
    return {path: (len(node.text), node.tenants[tenant], path[:len(path) - len(node.text)])
            for path, node in walk_nodes(tree) if tenant in node.tenants}


def reference_evict(view: dict[str, tuple[int, float, str]], bound: int) -> set[str]:
    """Remove the oldest leaf (a node none of whose children is kept) until the kept characters fit ``bound``."""
    kept = dict(view)
    size = sum(length for length, _, _ in kept.values())
    while size > bound:
        parents = {parent for _, _, parent in kept.values()}
        leaf = min((p for p in kept if p not in parents), key=lambda p: kept[p][1])
        size -= kept.pop(leaf)[0]
    return set(kept)


evict_ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), texts, st.sampled_from("xyz")),
    st.tuples(st.just("evict"), st.integers(0, 30), st.just("")),
), min_size=5, max_size=50)


@settings(max_examples=400, deadline=None)
@given(evict_ops, st.one_of(st.none(), st.permutations(range(1, 51))))
def test_eviction_removes_oldest_leaves_first(sequence, shuffled_stamps):
    # Several passes with inserts in between: a leaf the tree forgot to queue shows up in a later pass.
    # Stamps are increasing (a monotonic clock) or, to test out-of-order arrivals, a permutation.
    tree = RadixTree()
    clock = iter(shuffled_stamps) if shuffled_stamps else itertools.count(1)
    for op, arg, tenant in sequence:
        if op == "insert":
            tree.insert(arg, tenant, next(clock))
            continue
        expected = {t: reference_evict(tenant_view(tree, t), arg) for t in tree.tenants()}
        before = {t: set(tenant_view(tree, t)) for t in tree.tenants()}
        tree.evict(arg)
        check_structure(tree)
        for t in tree.tenants():
            assert tree.tenant_size(t) <= arg
            after = set(tenant_view(tree, t))
            assert after == expected[t], f"tenant {t}: kept {sorted(after)}, LRU reference {sorted(expected[t])}"
            assert after <= before[t]


def test_eviction_is_lru_on_a_small_case():
    tree = RadixTree()
    tree.insert("system: hi|alpha", "w", 1.0)
    tree.insert("system: hi|beta", "w", 2.0)
    tree.insert("system: hi|gamma", "w", 3.0)
    tree.insert("system: hi|alpha again", "w", 4.0)  # touches alpha's path: beta is now the oldest leaf
    size = tree.tenant_size("w")
    tree.evict(size - 1)
    assert tree.match("system: hi|beta")[0] == len("system: hi|")
    assert tree.match("system: hi|alpha again")[0] == len("system: hi|alpha again")
    assert tree.tenant_size("w") == size - len("beta")
    check_structure(tree)


def test_eviction_takes_an_older_leaf_before_a_newer_parent():
    tree = RadixTree()
    tree.insert("abc", "w", 1.0)
    tree.insert("x", "w", 2.0)
    tree.insert("ab", "w", 3.0)  # splits "abc": parent "ab" (3.0) above leaf "c" (1.0)
    tree.evict(2)  # "c" (1.0) goes, then "x" (2.0) is older than the parent "ab" (3.0) that just became a leaf
    assert (tree.match("abc")[0], tree.match("x")[0], tree.tenant_size("w")) == (2, 0, 2)
    check_structure(tree)


def test_eviction_with_equal_stamps_only_takes_leaves():
    tree = RadixTree()
    tree.insert("ab", "w", 5.0)
    tree.insert("abc", "w", 5.0)  # the entry queued for "ab" is popped first but "ab" is not a leaf
    tree.evict(2)
    assert (tree.match("abc")[0], tree.tenant_size("w")) == (2, 2)
    check_structure(tree)


def test_a_parent_queued_by_an_earlier_pass_goes_before_a_newer_one():
    tree = RadixTree()
    for text, stamp in [("p", 1.0), ("pc", 2.0), ("rx", 2.0), ("r", 3.0), ("z", 4.0)]:
        tree.insert(text, "w", stamp)  # nodes p(2) > c(2), r(3) > x(2), z(4): one char each
    tree.evict(4)  # c goes; its parent p (2.0) is queued for a later pass
    assert (tree.match("pc")[0], tree.tenant_size("w")) == (1, 4)
    tree.evict(2)  # x (2.0) goes; then p (2.0, queued) is older than x's parent r (3.0)
    assert (tree.match("p")[0], tree.match("r")[0], tree.match("z")[0]) == (0, 1, 1)
    check_structure(tree)


def test_eviction_keeps_shared_nodes_for_other_tenants():
    tree = RadixTree()
    tree.insert("shared prefix A, then a tail only x has", "x", 1.0)
    tree.insert("shared prefix B", "y", 2.0)
    tree.insert("shared prefix A", "y", 3.0)
    tree.evict(16)  # x (39 chars) loses its own tail; the nodes it shares with y (16 chars) stay
    assert (tree.tenant_size("x"), tree.tenant_size("y")) == (15, 16)
    matched, tenants, _ = tree.match("shared prefix A, then")
    assert matched == len("shared prefix A") and set(tenants) == {"x", "y"}
    assert tree.total_chars == 16
    check_structure(tree)


def test_eviction_keeps_the_bound_on_a_long_random_run():
    rng = random.Random(0)
    tree = RadixTree()
    convs = ["".join(rng.choice("abcd") for _ in range(20)) for _ in range(40)]
    for step in range(3000):
        c = rng.randrange(len(convs))
        convs[c] += "".join(rng.choice("abcd") for _ in range(rng.randint(1, 8)))
        tree.insert(convs[c], f"w{c % 3}", float(step))
        if step % 500 == 499:
            tree.evict(400)
            assert all(tree.tenant_size(t) <= 400 for t in tree.tenants())
            check_structure(tree)
    # stale eviction entries do not pile up without bound
    assert sum(map(len, tree._queues.values())) <= 2 * tree.node_count + 1024 + 500


def test_remove_tenant_drops_nodes_only_it_held():
    tree = RadixTree()
    tree.insert("abcdef", "x", 1.0)
    tree.insert("abcxyz", "y", 2.0)
    tree.remove_tenant("x")
    assert tree.tenant_size("x") == 0 and "x" not in tree.tenants()
    assert tree.match("abcdef")[:2] == (3, {"y": 2.0})
    assert tree.total_chars == len("abcxyz")
    check_structure(tree)


def test_split_keeps_sizes_and_stamps():
    tree = RadixTree()
    tree.insert("hello world", "x", 1.0)
    assert tree.insert("hello", "y", 2.0) == 0
    matched, tenants, node = tree.match("hello!")
    assert matched == 5 and tenants == {"x": 1.0, "y": 2.0} and node.text == "hello"
    assert (tree.tenant_size("x"), tree.tenant_size("y")) == (11, 5)
    assert tree.insert("hello world!", "x", 3.0) == 11
    check_structure(tree)


@pytest.mark.parametrize("text", ["", "z"])
def test_match_on_an_empty_or_missing_prefix(text):
    tree = RadixTree()
    tree.insert("abc", "x", 1.0)
    matched, tenants, node = tree.match(text)
    assert matched == 0 and dict(tenants) == {} and node is tree.root
