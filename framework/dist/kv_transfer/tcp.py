"""servelab's fallback transport: Mooncake's one-sided writes over a plain TCP socket, where Mooncake's package is
absent. Each process listens on a port of its own; a writer sends a batch (a header, each write's destination and
length, then the bytes) and the receiving thread copies the bytes straight into the registered destination
(recv_into over the destination's memory: no staging copy) before it acknowledges the batch. A destination outside
every registered region is refused before a byte lands."""
from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading

from framework.dist.kv_transfer.transport import Transport, TransferError, coalesce

log = logging.getLogger(__name__)
MAGIC = b"SLKV"
HEADER = struct.Struct("!4sI")          # magic, number of writes
ENTRY = struct.Struct("!QQ")            # destination address, bytes
OK, REFUSED = b"\x01", b"\x00"
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the writer closed the connection mid-batch")
        view = view[got:]


def _memory(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: str):
        self._regions: list[tuple[int, int]] = []
        self._server = socket.create_server((host, 0))       # a server of this process: the kernel picks the port
        self._endpoint = f"{host}:{self._server.getsockname()[1]}"
        self._peers: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, addr: int, nbytes: int) -> None:
        self._regions.append((addr, nbytes))

    # -- writer side ------------------------------------------------------------------------------------------
    def write(self, peer: str, ops: list[tuple[int, int, int]]) -> None:
        ops = coalesce(ops)
        if not ops:
            return
        with self._lock:                      # one batch at a time per peer connection
            try:
                sock = self._peers.get(peer) or self._connect(peer)
                sock.sendall(HEADER.pack(MAGIC, len(ops)) + b"".join(ENTRY.pack(dst, n) for _, dst, n in ops))
                for src, _, n in ops:
                    sock.sendall(_memory(src, n))
                reply = _recv_exact(sock, 1)
            except OSError as e:
                self._drop(peer)
                raise TransferError(f"tcp: a write to {peer} failed: {type(e).__name__}: {e}") from None
            if reply != OK:
                self._drop(peer)
                raise TransferError(f"tcp: {peer} refused the write (a destination outside its registered memory)")

    def _connect(self, peer: str) -> socket.socket:
        host, port = peer.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[peer] = sock
        return sock

    def _drop(self, peer: str) -> None:
        sock = self._peers.pop(peer, None)
        if sock is not None:
            sock.close()

    # -- receiver side ----------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-recv", daemon=True).start()

    def _inside(self, dst: int, n: int) -> bool:
        return any(base <= dst and dst + n <= base + size for base, size in self._regions)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                    if not head:
                        return                      # the writer closed its connection
                    magic, count = HEADER.unpack(head)
                    if magic != MAGIC:
                        return
                    entries = [ENTRY.unpack_from(b, 0) for b in
                               (_recv_exact(conn, ENTRY.size) for _ in range(count))]
                    if not all(self._inside(dst, n) for dst, n in entries):
                        conn.sendall(REFUSED)
                        return
                    for dst, n in entries:
                        _recv_into(conn, _memory(dst, n))
                    conn.sendall(OK)
            except (OSError, ConnectionError, struct.error) as e:
                log.debug("kv tcp receiver: %s", e)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for peer in list(self._peers):
                self._drop(peer)
