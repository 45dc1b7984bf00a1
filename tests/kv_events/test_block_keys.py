"""The router's block keys (framework/kv_events/hashing.py), in C (native_keys.c) and in Python: chained (a sequence's keys
are its prefix's, then the rest's on the last of them), full blocks only, the same for a block whether it comes as
bytes or as token ids, also inside a sequence with tokens of 256 or more; the C table of a worker's block counts
(``BlockCounts``) answers as a Counter does, through growth, deletions and shrinking, and the C match reads it as it
reads a dict; and the C extension is built wherever the install had a C compiler (else the Python path runs, which
would hide a broken build)."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings, strategies as st

from collections import Counter

from framework.kv_events import hashing
from framework.kv_events.hashing import NATIVE, ROOT_HASH, BlockCounts, BlockKeys

needs_c = pytest.mark.skipif(not NATIVE, reason="the C extension is not built")
MODES = [pytest.param(False, id="python"), pytest.param(True, id="c", marks=needs_c)]
B = 4


def test_the_c_extension_is_built_where_a_compiler_is():
    if os.environ.get("SERVELAB_NO_EXTENSIONS"):
        pytest.skip("SERVELAB_NO_EXTENSIONS is set: the Python path on purpose")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the install skipped the extension (optional), the Python path runs")
    assert NATIVE, f"a C compiler is here but the C keys are off ({hashing.WHY_PYTHON}): run pip install -e ."


@pytest.mark.parametrize("native", MODES)
@settings(max_examples=60, deadline=None)
@given(head=st.integers(0, 6), text=st.binary(max_size=40))
def test_keys_chain_over_a_split(native, head, text):
    keys = BlockKeys(B, native)
    whole = list(keys.chain(text))
    cut = min(head * B, len(text) // B * B)
    first = list(keys.chain(text[:cut]))
    rest = list(keys.chain(text[cut:], first[-1] if first else ROOT_HASH))
    assert whole == first + rest and len(whole) == len(text) // B  # a trailing partial block has no key
    assert list(keys.chain(list(text))) == whole  # token ids below 256: the same blocks
    assert len(set(whole)) == len(whole)  # chained: a block repeated deeper has another parent, so another key


@pytest.mark.parametrize("native", MODES)
def test_a_block_of_byte_tokens_keys_alike_in_a_sequence_with_large_tokens(native):
    """A worker's event carries one run of blocks on its parent: a run of tokens below 256 after a block with a token
    of 300 gets the keys the whole sequence gave it."""
    keys = BlockKeys(B, native)
    tokens = [1, 2, 3, 300] + list(b"abcdefgh") + [7, 70000, 9, 9]
    whole = list(keys.chain(tokens))
    assert len(whole) == 4
    assert list(keys.chain(tokens[:4])) == whole[:1]
    assert list(keys.chain(tokens[4:12], whole[0])) == whole[1:3]  # bytes-only run, on the large-token parent
    assert list(keys.chain(bytes(tokens[4:12]), whole[0])) == whole[1:3]
    assert list(keys.chain(tokens[12:], whole[2])) == whole[3:]
    assert list(keys.chain([1, 2, 3, 44])) != whole[:1]


@needs_c
def test_c_keys_are_words_that_other_parents_and_blocks_change():
    keys = BlockKeys(B, True)
    got = keys.chain(b"abcdabcdabcd")
    assert type(got) is array and got.typecode == "Q" and all(0 < k < 2**62 for k in got)
    assert len(set(got)) == 3  # equal blocks at other depths: other keys (their parents differ)
    assert keys.chain(b"abcd", 1)[0] != keys.chain(b"abcd", 2)[0] != keys.chain(b"abce", 2)[0]
    assert keys.chain(b"abc") == array("Q")


@needs_c
def test_c_keys_are_salted_per_process_unless_pythonhashseed_fixes_them():
    """Like CPython's str and bytes hashes: another process, other keys (a client cannot aim at a collision); a fixed
    PYTHONHASHSEED repeats them."""
    code = "from framework.kv_events.hashing import BlockKeys; print(list(BlockKeys(4).chain(b'abcdefgh')))"

    def keys(seed: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed:
            env["PYTHONHASHSEED"] = seed
        return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                              env=env).stdout
    assert keys("") != keys("") and keys("random") != keys("random")
    assert keys("0") == keys("0") != keys("1")


@needs_c
def test_c_calls_say_what_was_wrong():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        hashing.native_keys.keys(b"abcd", 0, 0)
    with pytest.raises(TypeError, match=r"array\('Q'\), as keys\(\) makes them, not list"):
        hashing.held_prefixes([1, 2], {}, ["w"])
    with pytest.raises(TypeError, match=r"array\('Q'\)"):
        hashing.held_prefixes(b"12345678", {}, ["w"])
    with pytest.raises(TypeError, match="candidates: list"):
        hashing.held_prefixes(array("Q"), {}, ("w",))
    with pytest.raises(TypeError, match=r"a worker's name \(str\), not int"):
        hashing.held_prefixes(array("Q"), {}, [3])
    with pytest.raises(TypeError, match="must be a dict"):
        hashing.held_prefixes(array("Q", [1]), {"w": None}, ["w"])
    with pytest.raises(TypeError, match="integer"):
        hashing.native_keys.keys(b"abcd", "4", 1.5)  # the first bad argument is the one named


@needs_c
def test_c_match_keeps_a_bound_inside_the_keys():
    keys = BlockKeys(B, True).chain(b"abcdefghijkl")
    held = {"w": {k: 1 for k in keys}}
    for bound, want in ((2**60, 3), (3, 3), (2, 2), (1, 1), (-5, 1)):  # holds block 1: at least that (as Python)
        assert hashing.held_prefixes(keys, held, ["w"], {"w": bound}) == {"w": want}

@needs_c
def test_the_deepest_key_in_a_table():
    keys = BlockKeys(B, True).chain(b"abcdefghijkl")
    assert hashing.deepest_in(keys, {keys[0]: 1, keys[1]: 2}) == keys[1]
    assert hashing.deepest_in(keys, {keys[2]: 1, keys[0]: 2}) == keys[2]
    assert hashing.deepest_in(keys, {7: 1}) is None and hashing.deepest_in(array("Q"), {}) is None
    with pytest.raises(TypeError, match=r"array\('Q'\)"):
        hashing.deepest_in(b"12345678", {})


# a few keys that collide in a small table (their top bits agree once multiplied), and words at both ends
KEY = st.one_of(st.integers(0, 40), st.integers(2**64 - 3, 2**64 - 1), st.sampled_from([0, 1 << 60, 1 << 63, 12345]))
COUNT_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(KEY, max_size=30)),  # a credit: each key once more
    st.tuples(st.just("drop"), KEY),                        # _drop: one less, gone at 0
    st.tuples(st.just("set"), KEY, st.integers(0, 3)),      # 0 removes it
    st.tuples(st.just("del"), KEY)), max_size=60)


@needs_c
@settings(max_examples=150, deadline=None)
@given(ops=COUNT_OPS, probes=st.lists(KEY, max_size=20))
def test_the_c_counts_answer_as_a_counter(ops, probes):
    table, model = BlockCounts(), Counter()
    for op, *args in ops:
        if op == "add":
            table.add(array("Q", args[0]))
            model.update(args[0])
        elif op == "drop":
            key = args[0]
            if model[key]:
                n = table[key] - 1
                if n:
                    table[key] = n
                else:
                    del table[key]
                model[key] -= 1
                model += Counter()  # drops the zeros
        elif op == "set":
            key, n = args
            table[key] = n
            model[key] = n
            model += Counter()
        else:
            key = args[0]
            if model[key]:
                del table[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        assert len(table) == len(model)
        for key in {*model, *probes}:
            assert (key in table) == (key in model) and table[key] == model[key]
        assert -1 not in table and 2**64 not in table and table[-1] == 0  # no such key: as a dict of 64-bit keys


def homed(slot: int, bits: int, low: int) -> int:
    """A key whose home slot in a table of 2**bits slots is ``slot`` (the table's hash inverted: Fibonacci hashing,
    the top bits of key * 0x9E3779B97F4A7C15); ``low`` tells apart keys of one home."""
    return (((slot << (64 - bits)) | low) * pow(0x9E3779B97F4A7C15, -1, 2**64)) % 2**64


@needs_c
def test_c_counts_delete_across_the_end_of_the_table():
    # homes 14, 15, 15, 0, 0, 1 of 16 slots: the run wraps past the last slot, and a deletion must shift back across it
    keys = [homed(14, 4, 1), homed(15, 4, 2), homed(15, 4, 3), homed(0, 4, 4), homed(0, 4, 5), homed(1, 4, 6)]
    for order in itertools.permutations(keys):
        for gone in keys:
            table = BlockCounts()
            table.add(array("Q", order))
            del table[gone]
            assert table.slots == 16 and len(table) == 5 and gone not in table
            assert all(table[k] == 1 for k in keys if k != gone)


@needs_c
def test_the_c_counts_grow_and_shrink_with_what_is_held():
    table = BlockCounts()
    keys = array("Q", BlockKeys(B, True).chain(os.urandom(B * 5000)))
    table.add(keys)
    table.add(keys[:10])
    assert len(table) == 5000 and table[keys[0]] == 2 and table[keys[-1]] == 1
    assert 2 * len(table) <= table.slots <= 4 * len(table)  # at most half full, grown by doubling
    assert sys.getsizeof(table) >= 16 * table.slots  # its slots counted
    for key in keys[10:]:
        del table[key]
        assert table.slots <= max(16, 8 * len(table))  # below an eighth full it shrinks at once
    assert len(table) == 10 and all(table[k] == 2 for k in keys[:10]) and keys[10] not in table
    assert table.slots <= 64  # shrunk with what it holds: 10 keys, at most a quarter full after a shrink
    keys_left = BlockKeys(B, True).chain(b"abcdefgh")
    assert hashing.held_prefixes(keys_left, {"w": table}, ["w"]) == {"w": 0}
    table.add(keys_left)
    assert hashing.held_prefixes(keys_left, {"w": table}, ["w"]) == {"w": 2}


@needs_c
def test_c_counts_say_what_was_wrong():
    table = BlockCounts()
    with pytest.raises(TypeError, match="a key is an int"):
        "7" in table
    with pytest.raises(ValueError, match="a count is >= 0"):
        table[7] = -1
    with pytest.raises(TypeError, match="a count is an int"):
        table[7] = 1.0
    with pytest.raises(TypeError, match=r"array\('Q'\)"):
        table.add([1, 2])
    with pytest.raises(TypeError, match="no arguments"):
        BlockCounts({1: 2})


def test_asking_for_c_keys_without_the_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(hashing, "native_keys", None)
    with pytest.raises(ValueError, match="pip install -e ."):
        BlockKeys(4, True)
    assert BlockKeys(4, False).native is False
