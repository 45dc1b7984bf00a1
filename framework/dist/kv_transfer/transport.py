"""The transport interface: what a KV connector needs to move bytes between two processes' memory (the shape of
Mooncake's transfer engine: register a region, then synchronous one-sided writes into a peer's registered region)."""
from __future__ import annotations

from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A write did not complete (the peer is gone, refused the region, or timed out)."""


class Transport(ABC):
    name: str = ""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """"host:port": where peers reach this process's registered memory."""

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None:
        """Let peers write into [addr, addr + nbytes) of this process (and this process read it as a source)."""

    @abstractmethod
    def write(self, peer: str, ops: list[tuple[int, int, int]]) -> None:
        """Copy each (local source address, peer destination address, bytes) into `peer`'s registered memory;
        returns once every byte has landed. Raises TransferError."""

    def close(self) -> None:
        pass


def coalesce(ops: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge writes whose source and destination both continue the previous one (consecutive KV slots)."""
    out: list[list[int]] = []
    for src, dst, n in ops:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1][2] += n
        else:
            out.append([src, dst, n])
    return [tuple(o) for o in out]
