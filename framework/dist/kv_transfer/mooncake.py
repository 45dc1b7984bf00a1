"""Mooncake's transfer engine (the package `mooncake-transfer-engine-non-cuda`, the optional extra `pd`) over TCP:
what SGLang's disaggregation uses by default (`--disaggregation-transfer-backend mooncake`). Peers find each other by
P2P handshake (no metadata server): a peer is "host:rpc_port". On a GPU cluster the CUDA build with RDMA plugs in
here unchanged but for the protocol string."""
from __future__ import annotations

import functools
import os

from framework.dist.kv_transfer.transport import Transport, TransferError, coalesce

# Mooncake's TCP transport queues at most this many requests per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, 1024 by
# default in 0.3.13) and refuses the rest of a batch once its short admission queue is full too ("TCP lane
# queue-full rejection"): a batch of more than ~2048 writes fails as a whole. A request's KV is one write per layer per
# run of consecutive slots, so a fragmented decode pool (a busy one) crosses that with a few thousand tokens.
DEFAULT_QUEUED_PER_PEER = 1024


def batch_limit() -> int:
    """The most writes one batch may carry: the per-peer queue Mooncake is configured with."""
    try:
        return max(1, int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", DEFAULT_QUEUED_PER_PEER)))
    except ValueError:
        return DEFAULT_QUEUED_PER_PEER


@functools.cache
def load_error() -> str | None:
    """None when Mooncake's engine imports, else why not (one line)."""
    os.environ.setdefault("GLOG_minloglevel", "2")        # its handshake logs every lookup at INFO otherwise
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"Mooncake's transfer engine does not load ({e})"
    return None


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, host: str):
        if (why := load_error()) is not None:
            raise TransferError(why)
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransferError(f"Mooncake's transfer engine did not start on {host}")
        self._endpoint = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []
        self._batch = batch_limit()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, addr: int, nbytes: int) -> None:
        if self.engine.register_memory(addr, nbytes) != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {addr:#x}")
        self._registered.append((addr, nbytes))

    def write(self, peer: str, ops: list[tuple[int, int, int]]) -> None:
        ops = coalesce(ops)
        for i in range(0, len(ops), self._batch):         # batches its per-peer queue takes whole
            srcs, dsts, lens = map(list, zip(*ops[i:i + self._batch]))
            if self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens) != 0:
                raise TransferError(f"Mooncake: a batch of {len(lens)} writes ({sum(lens)} bytes) to {peer} failed "
                                    f"(peer gone, or a region not registered there)")

    def close(self) -> None:
        for addr, _ in self._registered:
            self.engine.unregister_memory(addr)
        self._registered = []
