"""KV cache events in vLLM's wire format: what a worker's prefix cache stored and dropped, block by block.

- ``events``: the messages (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in a ``KVEventBatch``) and their
  msgpack encoding, as vLLM's ``--kv-events-config`` publishes them (and SGLang's publisher since);
- ``hashing``: block hashes chained over fixed-size token blocks;
- ``emitter``: turns the radix cache's inserts and evictions (page size 1) into block events;
- ``publisher``: the worker side, ZMQ PUB with sequence numbers and a replay socket (vLLM's ``ZmqEventPublisher``
  protocol);
- ``subscriber``: the router side, one ZMQ SUB per worker endpoint, which replays or resyncs on a gap or a restart;
- ``relay``: a DP group's events batched per step, stamped with its ``data_parallel_rank``, on their way out of its
  rank (to rank 0's DP controller, or to the worker process that publishes every group's on its one stream);
- ``worker``: a worker process's publisher wired to its instance's caches;
- ``union``: several DP groups' events as one worker's, for a router that sees the worker whole;
- ``ranks``: where each DP rank of a vLLM or SGLang worker publishes (its own stream, the port offset by the rank).
"""
