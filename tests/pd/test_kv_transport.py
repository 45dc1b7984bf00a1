"""The KV transports (framework/dist/kv_transfer): one-sided writes land in a peer's registered memory byte for byte,
a destination outside it is refused, a dead peer is an error, and `auto` picks Mooncake only where it loads."""
from __future__ import annotations

import pytest
import torch

from framework.dist.kv_transfer import TransferError, open_transport, resolve_backend, transport_names
from framework.dist.kv_transfer.mooncake import load_error
from framework.dist.kv_transfer.transport import coalesce

BACKENDS = ["tcp", pytest.param("mooncake", marks=[pytest.mark.long, pytest.mark.skipif(   # ~2 s: its handshakes
    load_error() is not None, reason=f"Mooncake's transfer engine does not load here ({load_error()})")])]


@pytest.mark.parametrize("name", BACKENDS)
def test_writes_land_in_the_peers_registered_memory(name):
    src_t, dst_t = open_transport(name, "127.0.0.1"), open_transport(name, "127.0.0.1")
    try:
        src = torch.randn(3, 50, 16)                   # [layer, slot, width], as a KV pool
        dst = torch.zeros(3, 60, 16)
        src_t.register(src.data_ptr(), src.numel() * 4)
        dst_t.register(dst.data_ptr(), dst.numel() * 4)
        row = 16 * 4
        slots = [(5, 7), (6, 8), (7, 9), (20, 2)]      # (source slot, destination slot): runs and a gap
        ops = [(src.data_ptr() + (layer * 50 + s) * row, dst.data_ptr() + (layer * 60 + d) * row, row)
               for layer in range(3) for s, d in slots]
        src_t.write(dst_t.endpoint, ops)
        for s, d in slots:
            assert torch.equal(dst[:, d], src[:, s])
        assert int((dst.abs().sum(-1) > 0).sum()) == 3 * len(slots)      # nothing else was written
        with pytest.raises(TransferError):
            src_t.write(dst_t.endpoint, [(src.data_ptr(), dst.data_ptr() + dst.numel() * 4, row)])
        dead = open_transport(name, "127.0.0.1")
        endpoint = dead.endpoint
        dead.close()
        with pytest.raises(TransferError):
            src_t.write(endpoint, ops[:1])
    finally:
        src_t.close()
        dst_t.close()


def test_coalesce_merges_runs_that_continue_on_both_sides():
    assert coalesce([(0, 100, 8), (8, 108, 8), (16, 200, 8), (24, 208, 8), (40, 216, 8)]) == \
        [(0, 100, 16), (16, 200, 16), (40, 216, 8)]


def test_backend_names():
    assert resolve_backend("auto") == ("mooncake" if load_error() is None else "tcp")
    assert {"auto", "tcp", "mooncake"} <= set(transport_names())
    with pytest.raises(ValueError, match="is not one of auto, "):
        resolve_backend("nixl")


@pytest.mark.parametrize("name", BACKENDS)
def test_a_fragmented_pools_many_writes_land(name):
    """A request's KV into a fragmented decode pool: one write per layer per slot (nothing coalesces), 3 x 1,000,
    more than Mooncake's TCP transport queues for one peer (its 0.3.13 default refused such a batch whole)."""
    src_t, dst_t = open_transport(name, "127.0.0.1"), open_transport(name, "127.0.0.1")
    try:
        layers, n, width = 3, 1000, 16
        src = torch.randn(layers, n, width)
        dst = torch.zeros(layers, 2 * n, width)
        src_t.register(src.data_ptr(), src.numel() * 4)
        dst_t.register(dst.data_ptr(), dst.numel() * 4)
        row = width * 4
        ops = [(src.data_ptr() + (layer * n + s) * row, dst.data_ptr() + (layer * 2 * n + 2 * s) * row, row)
               for layer in range(layers) for s in range(n)]           # every other destination slot
        assert len(coalesce(ops)) == layers * n
        src_t.write(dst_t.endpoint, ops)
        assert torch.equal(dst[:, ::2], src) and not dst[:, 1::2].any()
    finally:
        src_t.close()
        dst_t.close()
