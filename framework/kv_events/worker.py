"""A worker's end of the KV events: a publisher on a free port, fed by the instance's radix caches."""
from __future__ import annotations

from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.publisher import ZmqEventPublisher


def publish_cache_events(client, host: str, block_size: int) -> tuple[ZmqEventPublisher, dict]:
    """Publish the KV events of the instance behind ``client`` (framework.instance.client.InstanceClient) on free
    ports of ``host``. A one-rank instance in this process: its radix cache's emitter feeds the publisher directly. A
    multi-rank one (opened with ``InstanceSpec.kv_events_block_size=block_size``): its rank 0 forwards every DP
    group's events as batches stamped with the group's ``data_parallel_rank``, which go out on the same stream.
    Returns the publisher (close it at exit) and what the worker advertises in ``/get_server_info`` under
    ``kv_events``."""
    publisher = ZmqEventPublisher(f"tcp://{host}:*", f"tcp://{host}:*")
    engine = client.local_engine
    if engine is not None:
        engine.scheduler.cache.observer = CacheEventEmitter(block_size, publisher.publish)
    else:
        client.on_kv_events = publisher.publish_batch
    publisher.info["block_size"] = block_size
    return publisher, publisher.info  # the same dict: its cleared_seq stays current
