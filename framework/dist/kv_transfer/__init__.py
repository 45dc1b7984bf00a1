"""KV transfer between instances: one-sided writes of registered memory from a prefill instance's KV pool into a
decode instance's (the data plane of prefill/decode disaggregation; the pairing and the control messages are the
instance's, framework/instance/kv_connector.py).

A transport is chosen by name (`engine.disaggregation_transfer_backend`): `mooncake` (Mooncake's transfer engine,
what SGLang uses by default; the optional extra `pip install -e '.[pd]'`, which needs the system's libibverbs),
`tcp` (servelab's fallback: the same one-sided writes over a plain socket, no extra package), or `auto` (mooncake
where it loads, else tcp). Another transport (NIXL, Mooncake over RDMA on a GPU cluster) registers a factory with
`register_transport` and is chosen by its name.
"""
from __future__ import annotations

from typing import Callable

from framework.dist.kv_transfer.transport import Transport, TransferError

TransportFactory = Callable[[str], Transport]       # host to advertise -> a started transport
_TRANSPORTS: dict[str, TransportFactory] = {}


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make a transport choosable by `name` (engine.disaggregation_transfer_backend)."""
    if name in _TRANSPORTS or name == "auto":
        raise ValueError(f"a KV transport named {name!r} is already registered")
    _TRANSPORTS[name] = factory


def transport_names() -> list[str]:
    return ["auto", *_TRANSPORTS]


def resolve_backend(name: str) -> str:
    """The transport `name` stands for: `auto` is mooncake where its package loads, else tcp. ValueError naming the
    choices for an unknown name, or for mooncake when its package does not load."""
    from framework.dist.kv_transfer import mooncake
    if name == "auto":
        return "mooncake" if mooncake.load_error() is None else "tcp"
    if name not in _TRANSPORTS:
        raise ValueError(f"engine.disaggregation_transfer_backend={name!r} is not one of {', '.join(transport_names())}")
    if name == "mooncake" and (why := mooncake.load_error()) is not None:
        raise ValueError(f"engine.disaggregation_transfer_backend=mooncake: {why}; install the extra "
                         f"(pip install -e '.[pd]', and the system's libibverbs1) or choose tcp")
    return name


def open_transport(name: str, host: str) -> Transport:
    """A started transport of the given name (resolved: not `auto`) that peers reach at `host`."""
    return _TRANSPORTS[resolve_backend(name)](host)


def _builtins() -> None:
    from framework.dist.kv_transfer.mooncake import MooncakeTransport
    from framework.dist.kv_transfer.tcp import TcpTransport
    register_transport("mooncake", MooncakeTransport)
    register_transport("tcp", TcpTransport)


_builtins()
__all__ = ["Transport", "TransferError", "register_transport", "transport_names", "resolve_backend", "open_transport"]
