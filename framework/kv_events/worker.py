"""A worker's end of the KV events: a publisher on a free port and the radix cache's emitter, wired together."""
from __future__ import annotations

from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.publisher import ZmqEventPublisher


def publish_cache_events(engine, host: str, block_size: int) -> tuple[ZmqEventPublisher, dict]:
    """Publish the KV events of ``engine``'s radix cache (a one-rank instance in this process; None for any other)
    on free ports of ``host``. Returns the publisher (close it at exit) and what the worker advertises in
    ``/get_server_info`` under ``kv_events``."""
    if engine is None:
        raise ValueError("KV events are published by one-rank instances only for now (parallel.size=1): a multi-rank "
                         "instance's caches live in its rank processes")
    publisher = ZmqEventPublisher(f"tcp://{host}:*", f"tcp://{host}:*")
    engine.scheduler.cache.observer = CacheEventEmitter(block_size, publisher.publish)
    publisher.info["block_size"] = block_size
    return publisher, publisher.info  # the same dict: its cleared_seq stays current
