"""Where each DP rank of a vLLM or SGLang worker publishes its KV events: one publisher per rank, on the configured
endpoint offset by the rank (vLLM vllm/distributed/kv_events.py and SGLang python/sglang/srt/disaggregation/
kv_events.py, ``ZmqEventPublisher.offset_endpoint_port``): a tcp endpoint's port + rank, an inproc or ipc endpoint's
name + ``_dp{rank}``, rank 0 unchanged; the replay endpoint likewise. vLLM's rank is the engine's
``data_parallel_rank``; SGLang's the scheduler's ``attn_dp_rank`` (0 for every scheduler without DP attention, so
only a worker under DP attention publishes per rank). Each batch is stamped with that rank too (vLLM: the batch's
``data_parallel_rank``; SGLang: the third field of its array-like batch, which decodes as the same).

servelab's own multi-rank workers publish every group on ONE stream instead (publisher.py); this module is for a
router that follows the others.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from framework.core.errors import UserError
from framework.kv_events.events import KVEventBatch


class RankStream(NamedTuple):
    """One DP rank's stream: its rank (None: the worker's only stream, whatever ranks its batches name), where it
    publishes and where it replays (None: no replay socket)."""
    rank: int | None
    endpoint: str
    replay_endpoint: str | None


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` as DP rank ``rank``'s publisher binds it (vLLM's and SGLang's ``offset_endpoint_port``)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or base == "tcp" or not port.isdigit():
            raise UserError(f"KV event endpoint {endpoint!r}: a tcp endpoint needs a port (tcp://host:5557) to "
                            f"offset by the DP rank")
        if int(port) + rank > 65535:
            raise UserError(f"KV event endpoint {endpoint!r}: DP rank {rank} would publish on port "
                            f"{int(port) + rank}, past 65535")
        return f"{base}:{int(port) + rank}"
    raise UserError(f"KV event endpoint {endpoint!r}: one of tcp://host:port, ipc://path or inproc://name")


def rank_streams(endpoint: str, replay_endpoint: str | None, dp_size: int) -> list[RankStream]:
    """The streams of a worker whose ``dp_size`` ranks each publish on ``endpoint`` offset by their rank; one rank:
    the worker's one stream (rank None), as a single-rank vLLM worker publishes."""
    if not isinstance(dp_size, int) or dp_size < 1:
        raise UserError(f"a worker's DP ranks publishing KV events must be >= 1, got {dp_size!r}")
    if dp_size == 1:
        return [RankStream(None, endpoint, replay_endpoint)]
    return [RankStream(r, offset_endpoint(endpoint, r), offset_endpoint(replay_endpoint, r)) for r in range(dp_size)]


def stamped(batch: KVEventBatch, rank: int | None) -> KVEventBatch:
    """``batch`` as rank ``rank``'s stream delivered it: the stream names the rank (a publisher of an older release
    stamps none); None leaves the batch as it came."""
    if rank is None or batch.data_parallel_rank == rank:
        return batch
    return dataclasses.replace(batch, data_parallel_rank=rank)
