"""Ports chosen before a child binds them (framework.core.ports): free when chosen, distinct, and outside the kernel's
ephemeral range, which outgoing connections draw from (a port chosen there could be taken before the child binds)."""
import socket

import pytest

from framework.core import ports


def listen_on(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def outside_ephemeral(port: int) -> bool:
    first, last = ports.ephemeral_range()
    return not first <= port <= last


def test_the_ephemeral_range_is_the_kernels():
    first, last = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert ports.ephemeral_range() == (first, last)


def test_free_ports_are_distinct_outside_the_ephemeral_range_and_bindable():
    chosen = ports.free_ports("127.0.0.1", 20)
    assert len(set(chosen)) == 20 and all(outside_ephemeral(p) and p >= ports.LOWEST_PORT for p in chosen)
    held = [listen_on(p) for p in chosen]      # every one is free: a server can listen on it
    for s in held:
        s.close()


def test_a_block_is_adjacent_free_ports_outside_the_ephemeral_range():
    base = ports.free_port_block("127.0.0.1", 5)
    assert all(outside_ephemeral(p) for p in range(base, base + 5))
    held = [listen_on(p) for p in range(base, base + 5)]
    for s in held:
        s.close()


def test_a_port_in_use_is_never_chosen(monkeypatch, tmp_path):
    """Only one candidate port (the range left is that port alone): while a server holds it, nothing is chosen."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "range").write_text(f"{port + 1}\t65535\n")
        monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
        monkeypatch.setattr(ports, "LOWEST_PORT", port)
        with pytest.raises(OSError, match="no 1 free ports"):
            ports.free_ports("127.0.0.1", 1)
        with pytest.raises(OSError, match="no block of 1 free ports"):
            ports.free_port_block("127.0.0.1", 1)
    assert ports.free_ports("127.0.0.1", 1) == [port] == [ports.free_port_block("127.0.0.1", 1)]  # free again


def test_an_unreadable_range_is_linuxs_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == ports.LINUX_DEFAULT_EPHEMERAL
