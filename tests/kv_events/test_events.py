"""KV event messages: servelab's encoding is vLLM's (maps tagged by "type" in an array batch), the older vLLM form (tagged
arrays) decodes too, and a payload that is not a batch fails with a message naming what is wrong."""
from __future__ import annotations

import msgpack
import pytest

from framework.kv_events.events import (AllBlocksCleared, BlockRemoved, BlockStored, KvEventError, KVEventBatch,
                                        decode_batch, encode_batch)


def test_round_trip_and_the_wire_layout():
    batch = KVEventBatch(12.5, (BlockStored((1, 2), None, (5, 6, 7, 8), 2), BlockRemoved((1,)), AllBlocksCleared()), 3)
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 3)
    assert events[0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                         "token_ids": [5, 6, 7, 8], "block_size": 2, "lora_id": None, "medium": None,
                         "lora_name": None}
    assert events[2] == {"type": "AllBlocksCleared"}
    no_rank = encode_batch(KVEventBatch(1.0, ()))
    assert msgpack.unpackb(no_rank) == [1.0, []]  # the rank is left out, as msgspec's omit_defaults does


def test_vllm_payloads_decode():
    """A batch as vLLM's msgspec encoder writes it (sha256 block hashes as bytes, extra fields), and the older form."""
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    current = msgpack.packb([3.0, [
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"}]], use_bin_type=True)
    batch = decode_batch(current)
    assert batch.events[0] == BlockStored((h1, h2), None, tuple(range(32)), 16, None, "GPU")
    assert batch.events[1] == BlockRemoved((h2,), "GPU") and batch.data_parallel_rank is None
    older = msgpack.packb([4.0, [["BlockStored", [7], 6, [1, 2], 2, None, None], ["AllBlocksCleared"]], 1])
    assert decode_batch(older) == KVEventBatch(4.0, (BlockStored((7,), 6, (1, 2), 2), AllBlocksCleared()), 1)


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not a msgpack"),
    (msgpack.packb({"ts": 1}), "a KV event batch is the array"),
    (msgpack.packb([1.0, [{"type": "BlockMoved"}]]), "unknown KV event type 'BlockMoved'"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "without the field 'block_hashes'"),
    (msgpack.packb([1.0, [42]]), "a KV event is a map"),
])
def test_bad_payloads_say_what_is_wrong(payload, message):
    with pytest.raises(KvEventError, match=message):
        decode_batch(payload)
