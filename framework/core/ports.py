"""Ports chosen before a child process binds them: a worker, the router, a multi-rank instance's rendezvous.

A port the kernel hands out (bind to port 0) comes from its ephemeral range (/proc/sys/net/ipv4/ip_local_port_range),
which every outgoing connection on the host also draws from: once the probing socket is closed, any connection
(an HTTP client, gloo between ranks) may take that port before the child binds it. So these ports are chosen outside
the ephemeral range, where only servers that ask for a port by number bind. Each is checked free when chosen; another
such server may still take it first, and the child's start then fails with "port in use", naming the port.
A server started in this process needs none of this: it binds port 0 and reads its port back.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST_PORT = 20000          # above the ports services commonly listen on (databases, web servers, 8000-9999)
PROBES = 200                 # choices tried before giving up (each a port, or a block, found in use)

_rng = random.SystemRandom()  # not the `random` module: a seeded test or run must not make every process pick alike


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), or Linux's default where it cannot be read."""
    try:
        first, last = map(int, EPHEMERAL_RANGE_FILE.read_text().split())
        return first, last
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL


def _bases(n: int) -> list[range]:
    """Where a block of n ports may start: below the ephemeral range, and above it, from LOWEST_PORT up. When the
    ephemeral range leaves no room (first <= LOWEST_PORT and last = 65535), anywhere from LOWEST_PORT: the retry on
    "port in use" is then all that protects the choice."""
    first, last = ephemeral_range()
    spans = [range(LOWEST_PORT, first - n + 1), range(max(last + 1, LOWEST_PORT), 65536 - n + 1)]
    spans = [s for s in spans if len(s) > 0]
    return spans or [range(LOWEST_PORT, 65536 - n + 1)]


def _pick_base(n: int) -> int:
    spans = _bases(n)
    return _rng.choice(_rng.choices(spans, weights=[len(s) for s in spans])[0])


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) as the servers bind (SO_REUSEADDR: a port in TIME_WAIT is free); OSError when
    something holds it."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def free_port_block(host: str, n: int = 1) -> int:
    """A base port with base .. base+n-1 all free on `host` now, outside the ephemeral range."""
    for _ in range(PROBES):
        base, held = _pick_base(n), []
        try:
            for port in range(base, base + n):
                held.append(_bind(host, port))
            return base
        except OSError:           # in use: try another block
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"no block of {n} free ports on {host} outside the ephemeral range {ephemeral_range()}")


def free_ports(host: str, n: int) -> list[int]:
    """n distinct ports that are free on `host` now, outside the ephemeral range (not necessarily adjacent)."""
    held: dict[int, socket.socket] = {}   # kept bound until all n are found, so that no port is chosen twice
    try:
        for _ in range(PROBES):
            if len(held) == n:
                break
            port = _pick_base(1)
            if port not in held:
                try:
                    held[port] = _bind(host, port)
                except OSError:
                    continue
        if len(held) < n:
            raise OSError(f"no {n} free ports on {host} outside the ephemeral range {ephemeral_range()}")
        return list(held)
    finally:
        for s in held.values():
            s.close()
