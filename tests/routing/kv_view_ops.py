"""The event and request operations the KvView property tests play (test_kv_view_index.py, test_match_hints.py), and
the block-by-block walk both use as their oracle."""
from __future__ import annotations

from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from framework.kv_events.hashing import ROOT_HASH, chain_hashes
from plugins.routing.lib.kv_view import KvView


def walked(view: KvView, keys: list[int], worker: str) -> int:
    n = 0
    while n < len(keys) and view.holds(worker, keys[n]):
        n += 1
    return n


def play(view: KvView, op: str, w: str, text: bytes, k: int, in_flight: list, now: float) -> None:
    """Apply one op to ``view`` (``in_flight``: (worker, credited keys, parent, depth, removals at the decision) of
    the requests credited and not ended, updated here)."""
    hashes = chain_hashes(list(text), view.block_size)
    b = view.block_size
    if op in ("store", "store_tail"):
        if hashes:
            first = min(k, len(hashes) - 1) if op == "store_tail" else 0  # a tail: chained on its parent's hash
            view.apply(w, BlockStored(tuple(hashes[first:]), hashes[first - 1] if first else None,
                                      tuple(text[first * b:len(hashes) * b]), b))
    elif op == "remove":  # any block, a middle one included (a cache that is not prefix-closed)
        if hashes:
            view.apply(w, BlockRemoved((hashes[k % len(hashes)],)))
    elif op == "clear":
        view.apply(w, AllBlocksCleared())
    elif op == "credit":
        keys = view.keys.chain(text)
        held = view.match(keys, [w])[w]
        parent = keys[held - 1] if held else ROOT_HASH
        view.credit(w, keys[held:], parent, held)
        in_flight.append((w, keys[held:], parent, held, view.removals))
    elif op in ("end", "fail"):
        if in_flight:
            worker, keys, parent, depth, since = in_flight.pop(k % len(in_flight))
            if op == "end":
                view.retire(worker, keys, parent, depth, now, since)
            else:
                view.debit(worker, keys, parent, depth)
    else:
        raise ValueError(f"unknown op {op!r}")
