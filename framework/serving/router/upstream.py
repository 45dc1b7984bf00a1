"""The router's client to its workers: kept-alive HTTP/1.1 connections, pooled per worker, on asyncio protocols with
httptools' response parser.

A request is written in one piece (head and body: the router already holds the whole body) and ``request`` returns
once the response head is in; the body is then read whole (``read``) or chunk by chunk as it arrives (``readany``,
b"" at its end). ``release`` puts the connection back in its pool when the response was read to its end and the
worker keeps it alive, and closes it otherwise (a response abandoned half-read, a timeout, a client that left).
Idle connections older than ``idle_s`` are not reused: a worker closes its idle connections after a while (aiohttp's
keep-alive timeout is 75 s), and a request written on one it is closing would fail for nothing.

The router's callback path (flight.py) uses a connection without awaiting: ``take`` a pooled one (or ``connect``),
``send`` with a ``flight`` that the parser's callbacks tell of the response's head (``on_head``), its end
(``on_complete``: the body is buffered whole) or a failure (``on_error``).

Errors are OSErrors: ``UpstreamConnectError`` (no connection could be opened: refused, unreachable, or not within
``connect_timeout_s``) and ``UpstreamClosed`` (the worker closed the connection before its response was whole).
"""
from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque

import httptools

Headers = list[tuple[bytes, bytes]]
_MEDIA_TYPES: dict[bytes, bytes] = {}  # a Content-Type value -> its media type, lower case
_BUFFER_LIMIT = 1 << 20  # bytes of a streamed response held before the socket stops being read


class UpstreamConnectError(OSError):
    """No connection to the worker could be opened."""


class UpstreamClosed(OSError):
    """The worker closed the connection before its response was whole."""


class UpstreamResponse(asyncio.Protocol):
    """One kept-alive connection, and the response being read on it."""

    def __init__(self, pool: "UpstreamPool", origin: tuple):
        self.pool, self.origin = pool, origin
        self.flight = None  # the callback path's request waiting on this connection (flight.py), if any
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.alive = True  # the connection is open
        self.idle_since = 0.0
        self._chunks: deque[bytes] = deque()
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.lower: dict[bytes, bytes] = {}
        self.keep_alive = False
        self.complete = False
        self._chunks.clear()
        self._buffered = 0
        self._paused = False
        self._whole = False  # the body is read whole (``read``, a flight): never stop reading the socket for it
        self._head: asyncio.Future | None = None
        self._more: asyncio.Future | None = None
        self._error: BaseException | None = None

    # ----------------------------------------------------------------------------- protocol and parser callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"malformed HTTP response: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.alive = False
        if not self.complete:
            self._fail(UpstreamClosed("the worker closed the connection" + (f" ({exc})" if exc else "")))

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()  # once: names travel lower-case (HTTP/1.1 names are case-insensitive)
        self.headers.append((name, value))
        self.lower[name] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.flight is not None:
            self.flight.on_head(self)
        elif self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _BUFFER_LIMIT and not self._paused and not self._whole:
            self._paused = True
            self.transport.pause_reading()
        if self._more is not None:
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if self.flight is not None:
            self.flight.on_complete(self)
        else:
            self._wake()

    def _wake(self) -> None:
        if self._more is not None and not self._more.done():
            self._more.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.on_error(self, exc)
        for fut in (self._head, self._more):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: a waiter that was cancelled meanwhile leaves no warning

    # ----------------------------------------------------------------------------- the caller's side

    def send(self, data: bytes, flight=None) -> None:
        """Write a whole request; the response is ``flight``'s (its callbacks) or ``request``'s (its futures)."""
        self._reset()
        self.flight = flight
        self._whole = flight is not None
        self.transport.write(data)

    def content_type(self) -> bytes:
        raw = self.lower.get(b"content-type", b"")
        ct = _MEDIA_TYPES.get(raw)
        if ct is None:  # workers repeat a few values: each is normalised once
            ct = raw.partition(b";")[0].strip().lower()
            if len(_MEDIA_TYPES) < 256:
                _MEDIA_TYPES[raw] = ct
        return ct

    def content_length(self) -> int | None:
        n = self.lower.get(b"content-length")
        return int(n) if n is not None and n.isdigit() else None

    async def _arrival(self) -> None:
        """Until more of the body (or its end) arrives; the connection's failure is raised."""
        if self._error is not None:
            raise self._error
        self._more = self.loop.create_future()
        try:
            await self._more
        finally:
            self._more = None

    async def readany(self) -> bytes:
        """The body's next chunk as it arrives; b"" at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            await self._arrival()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < _BUFFER_LIMIT // 2:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        while not self.complete:
            await self._arrival()
        return self.body()

    def body(self) -> bytes:
        """What arrived of the body, taken (the whole body once ``complete``)."""
        chunks = self._chunks
        body = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return body

    def release(self) -> None:
        """Back to the pool when reusable, closed otherwise."""
        self.flight = None
        if self.complete and self.keep_alive and self.alive and not self._chunks:
            self.idle_since = time.monotonic()
            self.pool._idle.setdefault(self.origin, []).append(self)
        else:
            self.close()

    def close(self) -> None:
        self.alive = False
        self.flight = None
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Kept-alive connections to the workers, by origin ``(host, port, https)``. No cap on their number: the routing
    policy and the admission limits bound the load."""

    def __init__(self, connect_timeout_s: float, idle_s: float = 30.0):
        self.connect_timeout_s, self.idle_s = connect_timeout_s, idle_s
        self._idle: dict[tuple, list[UpstreamResponse]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def connect(self, origin: tuple) -> UpstreamResponse:
        """A new connection to ``origin``."""
        host, port, https = origin
        if https and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamResponse(self, origin), host, port,
                                       ssl=self._ssl if https else None), self.connect_timeout_s)
        except TimeoutError:
            raise UpstreamConnectError(f"no connection to {host}:{port} within {self.connect_timeout_s:g}s "
                                       f"(router.connect_timeout_s)") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    def take(self, origin: tuple) -> UpstreamResponse | None:
        """A pooled connection to ``origin`` still fit for a request, if there is one."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.alive and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def request(self, origin: tuple, data: bytes) -> UpstreamResponse:
        """Write ``data`` (a whole HTTP/1.1 request) to the worker at ``origin``; returns once the response head is
        in. Cancelled or failed, the connection is closed."""
        conn = self.take(origin) or await self.connect(origin)
        try:
            conn.send(data)
            conn._head = head = conn.loop.create_future()  # (the answer cannot come in before this task waits)
            await head
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
