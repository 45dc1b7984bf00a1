"""Block hashes chained over fixed-size token blocks: block k of a sequence is named by a hash of (block k-1's hash,
its ``block_size`` tokens), so equal hashes mean equal prefixes, as in vLLM's prefix cache. Only full blocks count.

Two functions on purpose. ``chain_hashes`` is what servelab's workers publish: a hash of Python int tuples, the same
in every process (unlike str and bytes hashes, int and tuple hashes are not salted), 64 bits. ``BlockKeys`` is the
router's own key of a block, made from the tokens an event carries (so it follows workers whatever hash they publish,
vLLM's sha256 included) and from a request's tokens alike: it only needs to agree within one process, so it takes
the fastest form: a bytes slice per block for tokens below 256, as the byte tokenizer makes, hashed in C when the
extension is built (native_keys.c: SipHash-1-3, CPython's own bytes hash, keyed per process; the keys an ``array('Q')``),
else by CPython's tuple hash. The C path is what the pip install builds; without a C compiler, or with
``SERVELAB_NO_EXTENSIONS=1`` (any value but 0), the Python one runs. The two give other keys, and the same decisions.
"""
from __future__ import annotations

import hashlib
import os
import struct
from array import array
from typing import Sequence


def _salt() -> bytes:
    """16 random bytes per process, or fixed by PYTHONHASHSEED as it fixes CPython's own bytes hash (a run whose
    decisions are recorded and compared, experiments/soak/decision_yardstick.py, repeats its keys)."""
    seed = os.environ.get("PYTHONHASHSEED", "")
    if not seed.isdigit():  # unset, or CPython's word for a random salt
        return os.urandom(16)
    return hashlib.blake2b(seed.encode(), digest_size=16, person=b"servelab-keys").digest()


_CHAIN_API = 4  # native_keys.c's CHAIN_API: a build of an older source is not used (pip install -e . rebuilds it)
try:
    if os.environ.get("SERVELAB_NO_EXTENSIONS", "0") not in ("", "0"):
        raise ImportError("SERVELAB_NO_EXTENSIONS is set")
    from framework.kv_events import native_keys
    if getattr(native_keys, "API", None) != _CHAIN_API:
        raise ImportError(f"framework/kv_events/native_keys was built from another source (API "
                          f"{getattr(native_keys, 'API', None)}, this code needs {_CHAIN_API}): pip install -e . "
                          "rebuilds it")
    native_keys.seed(*struct.unpack("<QQ", _salt()))
    WHY_PYTHON = ""
except ImportError as e:
    native_keys, WHY_PYTHON = None, str(e)  # (why the Python path runs)
NATIVE = native_keys is not None  # the C keys are built and on
# (C) per candidate, the leading blocks of C keys it holds, where holdings are prefix-closed: KvView.match's search
held_prefixes = native_keys.match if NATIVE else None
# (C) the deepest of C keys in a dict, or None: precise_prefix's session lookup
deepest_in = native_keys.deepest if NATIVE else None
# (C) a worker's block counts as a flat table, read like a Counter (KvView's with the C keys; held_prefixes probes it)
BlockCounts = native_keys.Counts if NATIVE else None

MASK64 = 2**64 - 1
ROOT_HASH = 0  # the "parent" of a sequence's first block


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained hash of every full block of ``tokens`` (a trailing partial block has none), the first chained on
    ``parent`` (None: the sequence starts here)."""
    h = ROOT_HASH if parent is None else parent
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, *tokens[i:i + block_size])) & MASK64
        out.append(h)
    return out


def _canonical(block: Sequence[int]) -> bytes:
    """One bytes form per token sequence: the bytes themselves when every token is below 256, else 32-bit ints."""
    if isinstance(block, bytes):
        return block
    try:
        return bytes(block)
    except ValueError:  # a token of 256 or more
        return b"\xff" + array("I", block).tobytes()  # the marker keeps the two forms apart


class BlockKeys:
    """The router's keys of blocks, chained like ``chain_hashes`` but process-local (salted bytes hashes). ``native``:
    the C keys (default: when built, ``NATIVE``), an ``array('Q')``; else a list of CPython's hashes."""

    def __init__(self, block_size: int, native: bool | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if native and native_keys is None:
            raise ValueError("native block keys need the C extension framework/kv_events/native_keys.c built (pip install "
                             "-e . with a C compiler) and SERVELAB_NO_EXTENSIONS unset")
        self.block_size = block_size
        self.native = NATIVE if native is None else native
        self._blocks = struct.Struct(f"{block_size}s").iter_unpack  # bytes -> its blocks, each a bytes (1-tuples)

    def chain(self, tokens: Sequence[int], parent: int = ROOT_HASH) -> Sequence[int]:
        """Keys of every full block of ``tokens`` (bytes, or a sequence of ints), chained on ``parent``."""
        b = self.block_size
        if not isinstance(tokens, bytes):
            try:
                tokens = bytes(tokens)
            except ValueError:
                return self._chain_ints(tokens, parent)
        if self.native:
            return native_keys.keys(tokens, b, parent)
        if len(tokens) % b:
            tokens = tokens[:len(tokens) - len(tokens) % b]  # full blocks only
        h = parent
        # the blocks cut in C (struct), not a slice each in Python: about half the time per block
        return [h := hash((h, block)) for (block,) in self._blocks(tokens)]

    def _chain_ints(self, tokens: Sequence[int], parent: int) -> Sequence[int]:
        """A block at a time in its ``_canonical`` form: a block of tokens below 256 gets the key ``chain`` gives it."""
        b, h, out = self.block_size, parent, []
        for i in range(0, len(tokens) - b + 1, b):
            block = _canonical(tokens[i:i + b])
            h = native_keys.keys(block, len(block), h)[0] if self.native else hash((h, block))
            out.append(h)
        return array("Q", out) if self.native else out
