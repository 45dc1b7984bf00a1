"""The KV event messages and their encoding, as vLLM publishes them (vllm/distributed/kv_events.py).

On the wire a batch is a msgpack array ``[ts, events, data_parallel_rank]`` (the rank left out when there is none);
each event is a msgpack map tagged by ``"type"`` (vLLM's msgspec structs with ``tag=True``), e.g.
``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...], "block_size": 16,
"lora_id": None, "medium": None, "lora_name": None}``. Older vLLM releases encoded each event as a tagged array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``); both decode. A block
hash is an int (servelab, vLLM's builtin hashing) or bytes (vLLM's sha256 hashing): the view keys on it as it comes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import msgpack

BlockHash = Union[int, bytes]


class KvEventError(ValueError):
    """A payload that is not a KV event batch in the format above; the message says what was wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks now cached: ``block_hashes[i]`` covers ``token_ids[i * block_size:(i + 1) * block_size]`` and
    chains on the block before it (the first on ``parent_block_hash``; None: the first block of a sequence)."""
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer (fully) cached."""
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is cached any more (a flush)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float  # the publisher's wall clock, seconds
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def encode_batch(batch: KVEventBatch) -> bytes:
    events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": list(e.block_hashes),
                           "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                           "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium, "lora_name": None})
        elif isinstance(e, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium})
        elif isinstance(e, AllBlocksCleared):
            events.append({"type": "AllBlocksCleared"})
        else:
            raise TypeError(f"not a KV event: {e!r}")
    body = [batch.ts, events] + ([] if batch.data_parallel_rank is None else [batch.data_parallel_rank])
    return msgpack.packb(body, use_bin_type=True)


_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _event(raw) -> KVEvent:
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):  # older vLLM: a tagged array
        kind = raw[0]
        if kind not in _ARRAY_FIELDS:
            raise KvEventError(f"unknown KV event type {kind!r}; known: {', '.join(_ARRAY_FIELDS)}")
        raw = {"type": kind, **dict(zip(_ARRAY_FIELDS[kind], raw[1:]))}
    if not isinstance(raw, dict):
        raise KvEventError(f"a KV event is a map tagged by 'type' (or a tagged array), got {type(raw).__name__}")
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            return BlockStored(tuple(raw["block_hashes"]), raw.get("parent_block_hash"), tuple(raw["token_ids"]),
                               int(raw["block_size"]), raw.get("lora_id"), raw.get("medium"))
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(raw["block_hashes"]), raw.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except KeyError as e:
        raise KvEventError(f"{kind} event without the field {e.args[0]!r}") from None
    raise KvEventError(f"unknown KV event type {kind!r}; known: {', '.join(_ARRAY_FIELDS)}")


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise KvEventError(f"not a msgpack KV event batch: {e}") from None
    if not isinstance(body, (list, tuple)) or len(body) not in (2, 3) or not isinstance(body[1], (list, tuple)):
        raise KvEventError("a KV event batch is the array [ts, events] or [ts, events, data_parallel_rank]")
    rank = body[2] if len(body) == 3 else None
    return KVEventBatch(float(body[0]), tuple(_event(e) for e in body[1]), rank)
