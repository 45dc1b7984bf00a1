"""The prompt memo (kv_policy.PromptKeys) only decides how many blocks a decision hashes: on conversations that share
system prompts, grow turn by turn, branch, repeat a turn and diverge, every request's keys are those a hash from
scratch gives, and so are the keys of every prompt it still remembers after it extended their lists in place."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from framework.kv_events.hashing import BlockKeys
from plugins.routing.lib.kv_policy import PromptKeys

B = 4
SYSTEMS = (b"sys-one: " * 5, b"sys-two: " * 5, b"")  # long shared prefixes, and none
words = st.sampled_from([b"ab ", b"abc ", b"b ", b"zz ", b"q"])
# each step: (conversation, what it does, words of new text); prompts share a system prompt and diverge past it
steps = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["grow", "grow", "grow", "branch", "repeat", "restart"]),
                           st.lists(words, min_size=1, max_size=12)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(steps, st.integers(1, 6), st.integers(1, 4), st.integers(1, 5))
def test_memoised_keys_are_the_keys_of_a_hash_from_scratch(sequence, size, per_anchor, min_blocks):
    keys = BlockKeys(B, native=False)  # the memo serves the Python keys (the C ones hash whole)
    memo = PromptKeys(keys, size=size, per_anchor=per_anchor, min_blocks=min_blocks)
    history = [SYSTEMS[c % len(SYSTEMS)] for c in range(8)]
    for conversation, action, new in sequence:
        text = history[conversation]
        if action == "branch":  # an earlier turn continued differently: shares a prefix, then diverges
            text = text[:len(text) * 2 // 3]
        elif action == "restart":
            text = SYSTEMS[conversation % len(SYSTEMS)]
        if action != "repeat":
            text += b"".join(new)
        history[conversation] = text
        got = memo.keys(text)
        want = keys.chain(text)
        assert got == want
        assert 0 <= memo.continued <= len(got)
        assert len(memo) <= size
    for filed in memo._by_anchor.values():  # lists extended in place still belong to their own prompts
        for prompt, tail, remembered, _ in filed:
            assert remembered == keys.chain(prompt) and prompt.endswith(tail)


def test_a_conversation_hashes_only_its_new_blocks():
    keys = BlockKeys(B, native=False)  # the memo serves the Python keys (the C ones hash whole)
    memo = PromptKeys(keys, min_blocks=2)
    text = SYSTEMS[0]
    memo.keys(text)
    for turn in range(20):
        before = len(text) // B
        text += b"turn %d: some words. " % turn
        got = memo.keys(text)
        assert got == keys.chain(text) and memo.continued == before  # the turn before, whole


def test_a_continued_prompt_is_the_newest_of_the_memo():
    """The memo's bounds drop the least recently continued prompts: a conversation continued under its own anchor is
    the newest there (and in the memo's order), not where its previous turn was filed."""
    keys = BlockKeys(B, native=False)  # the memo serves the Python keys (the C ones hash whole)
    system = b"S" * (4 * B)  # a shared system prompt: block 4 is the anchor of every prompt of 4 to 7 blocks

    def turn(conversation: bytes, blocks: int) -> bytes:
        return (system + conversation * (8 * B))[:blocks * B]

    for size, per_anchor in ((64, 2), (2, 64)):  # the anchor's bound, then the memo's
        memo = PromptKeys(keys, size=size, per_anchor=per_anchor, min_blocks=4)
        memo.keys(turn(b"x", 5))
        memo.keys(turn(b"w", 5))  # filed after x, under the same anchor
        memo.keys(turn(b"x", 6))  # x continued: the most recent prompt
        memo.keys(turn(b"v", 5))  # one prompt over a bound: the least recent (w) goes
        assert memo.keys(turn(b"x", 7)) == keys.chain(turn(b"x", 7))
        assert memo.continued == 6, (size, per_anchor)
