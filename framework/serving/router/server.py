"""The router's HTTP/1.1 server: asyncio protocols with httptools' parser (llhttp, in C).

Why not aiohttp's server: its request and response objects, middleware chain and header multidicts cost ~270 us of
CPU per proxied request at 256 concurrent clients, twice what SGLang's Rust router spends on the whole request
(experiments/bench_router). This server hands the parsed request (method, path, query, raw header pairs, whole
body) and the connection to answer on to a plain function, ``on_request``, in the parser's callback; headers stay
bytes from the socket to the worker and back. ``on_request`` answers at once (``send``), or runs a coroutine for it
(``run``: one task per request, which the client leaving cancels), or leaves it to callbacks of its own: then it sets
``conn.flight``, an object whose ``client_gone()`` is called if the client leaves before the answer (the router's
callback path, flight.py, which spends no task and no await on a request).

Semantics kept from aiohttp as the router used it: keep-alive unless the client says otherwise; a body over
``max_body`` gets a 413 JSON error (and the connection closes); a malformed request a 400; a client that hangs up
cancels its handler (so the router drops the worker connection and the worker aborts the generation); an
exception a handler lets out becomes a logged 500; requests pipelined on one connection are answered in order.
Streamed answers use chunked transfer coding, and ``write`` waits while the client's socket buffer is full.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import ssl
from collections import deque
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import parse_qsl

import httptools

from framework.serving.http.errors import ApiError, json_bytes

log = logging.getLogger(__name__)
STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
Headers = list[tuple[bytes, bytes]]


class Request:
    """One parsed request. ``headers``: the (name, value) pairs in order, names in lower case; ``lower``: the same
    as a dict (the last of a repeated name)."""
    __slots__ = ("method", "path", "query_string", "headers", "lower", "body", "keep_alive", "rid")

    def __init__(self, method: str, path: str, query_string: str, headers: Headers, lower: dict[bytes, bytes],
                 body: bytes, keep_alive: bool):
        self.method, self.path, self.query_string = method, path, query_string
        self.headers, self.lower, self.body, self.keep_alive = headers, lower, body, keep_alive
        self.rid: bytes | None = None  # its request id, once the handler has settled it (returned on every answer)

    def header(self, lname: bytes, default: bytes | None = None) -> bytes | None:
        return self.lower.get(lname, default)

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string, keep_blank_values=True))


def head_bytes(status: int, headers: Headers, tail: bytes) -> bytes:
    line = STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()
    return line + b"".join([b"%s: %s\r\n" % kv for kv in headers]) + tail


OnRequest = Callable[[Request, "Connection"], None]
Handler = Callable[[Request, "Connection"], Awaitable[None]]


class Answering(abc.ABC):
    """How a handler answers: ``send`` (a whole response), or ``start``, ``await write`` each chunk, ``await end``
    (a streamed one). This server's Connection and the aiohttp shell (aiohttp_shell.py) both implement it."""

    @abc.abstractmethod
    def send(self, status: int, headers: Headers, body: bytes = b"") -> None:
        """One whole response."""

    def send_json(self, status: int, obj: object, headers: Headers = ()) -> None:
        self.send(status, [(b"Content-Type", b"application/json; charset=utf-8"), *headers], json_bytes(obj))

    def send_error(self, err: ApiError, headers: Headers = ()) -> None:
        extra = [(k.encode(), str(v).encode()) for k, v in (err.headers or {}).items()]
        self.send_json(err.status, err.to_dict(), [*extra, *headers])


class Connection(asyncio.Protocol, Answering):
    """One client connection."""

    def __init__(self, on_request: OnRequest, max_body: int, extra: Callable[[Request, int], Headers] | None,
                 live: set | None = None):
        self.on_request, self.max_body, self.extra, self.live = on_request, max_body, extra, live
        self.loop = asyncio.get_running_loop()  # (the protocol factory runs in the loop; one lookup per connection)
        self.active = True  # bytes came in since the last idle sweep (HttpServer.sweep)
        self.idle_sweeps = 0
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.task: asyncio.Task | None = None  # the coroutine answering the request (``run``)
        self.flight = None  # or the callbacks answering it: told ``client_gone()`` if the client leaves first
        self.pending: deque[Request] = deque()  # pipelined requests behind the one being answered
        self._drain: asyncio.Future | None = None
        self._url = b""
        self._headers: Headers = []
        self._lower: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        self.request: Request | None = None  # the one being answered
        self.started = False  # its response head went out

    # ----------------------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.live is not None:
            self.live.add(self)

    def data_received(self, data: bytes) -> None:
        self.active = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "upgrade is not supported")
        except httptools.HttpParserError as exc:
            if not self._too_large:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.live is not None:
            self.live.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its handler stops (and drops its worker connection)
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.client_gone()
        self._wake()

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self._drain is not None:
            if not self._drain.done():
                self._drain.set_result(None)
            self._drain = None

    # ----------------------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._lower, self._body, self._size = b"", [], {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()  # once: names travel lower-case from here on (HTTP/1.1 names are case-insensitive)
        self._headers.append((name, value))
        self._lower[name] = value

    def on_headers_complete(self) -> None:
        length = self._lower.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self._too_large = True
        elif b"expect" in self._lower and self._lower[b"expect"].lower() == b"100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            self._too_large = True
        if not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._too_large:
            self._refuse(413, f"body: request body exceeds the limit of {self.max_body} bytes", param="body")
            return
        path, _, query = self._url.decode("latin-1").partition("?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(self.parser.get_method().decode("ascii"), path, query, self._headers, self._lower, body,
                      self.parser.should_keep_alive())
        if self.request is None and self.task is None:
            self._begin(req)
        else:
            self.pending.append(req)

    # ----------------------------------------------------------------------------- answering

    def _begin(self, req: Request) -> None:
        self.request, self.started = req, False
        try:
            self.on_request(req, self)
        except Exception:
            self._failed(req)

    def _failed(self, req: Request) -> None:
        log.exception("unhandled error on %s %s", req.method, req.path)
        if self.request is req and not self.started and not self.closed:
            self.send_error(ApiError(500, f"internal error while handling {req.method} {req.path}"))
        elif self.transport is not None:
            self.transport.close()  # a response half sent cannot be completed

    def _next(self) -> None:
        """The next pipelined request, once the one before is answered and its handler done."""
        if self.pending and not self.closed and self.request is None and self.task is None:
            self._begin(self.pending.popleft())

    def run(self, handler: Awaitable[None]) -> None:
        """Answer the request being handled with a coroutine (``handler``), in a task of its own."""
        self.task = self.loop.create_task(self._serve(self.request, handler))

    async def _serve(self, req: Request, handler: Awaitable[None]) -> None:
        try:
            await handler
            if self.request is req:  # the handler returned without answering
                raise RuntimeError(f"no response to {req.method} {req.path}")
        except asyncio.CancelledError:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
        except (ConnectionResetError, BrokenPipeError):
            return  # the client went away; nothing to answer
        except Exception:
            self._failed(req)
        finally:
            self.task = None
        self._next()

    def _done(self) -> None:
        req, self.request = self.request, None
        if not req.keep_alive and self.transport is not None:
            self.transport.close()
        elif self.pending and self.task is None:  # answered without a task: the next one after this callback
            self.loop.call_soon(self._next)

    def _extra(self, status: int) -> Headers:
        return self.extra(self.request, status) if self.extra is not None else []

    def send(self, status: int, headers: Headers, body: bytes = b"") -> None:
        """The whole response at once (Content-Length set here)."""
        self.send_lines(status, b"".join([b"%s: %s\r\n" % kv for kv in headers]), body)

    def send_lines(self, status: int, lines: bytes, body: bytes = b"") -> None:
        """``send`` with the headers as their lines (each ending in CRLF), as a proxy may hold them already."""
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        req = self.request
        extra = self.extra(req, status) if self.extra is not None else None
        if extra:
            lines += b"".join([b"%s: %s\r\n" % kv for kv in extra])
        tail = b"Content-Length: %d\r\n\r\n" if req.keep_alive else b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        # one write, one system call: head and body together
        self.transport.write(b"%s%s%s%s" % (STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status,
                                            lines, tail % len(body), body))
        self._done()

    def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed response (chunked); ``write`` its chunks, then ``end``."""
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        headers = [*headers, *self._extra(status)]
        keep = b"" if self.request.keep_alive else b"Connection: close\r\n"
        self.transport.write(head_bytes(status, headers, b"Transfer-Encoding: chunked\r\n%s\r\n" % keep))
        self.started = True

    async def write(self, chunk: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if chunk:
            self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        if self._drain is not None:
            await asyncio.shield(self._drain)
            if self.closed:
                raise ConnectionResetError("the client closed the connection")

    async def end(self) -> None:
        if not self.closed:
            self.transport.write(b"0\r\n\r\n")
        self._done()

    def _refuse(self, status: int, message: str, param: str | None = None) -> None:
        """A request that cannot be handled (bad syntax, too large): answered, then the connection closes."""
        if self.closed or self.started:
            self.transport.close()
            return
        body = json_bytes(ApiError(status, message, param=param).to_dict())
        self.transport.write(head_bytes(status, [(b"Content-Type", b"application/json; charset=utf-8")],
                                        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body)
        self.transport.close()
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.client_gone()


def server_ssl_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    return ctx


class HttpServer:
    """A listening server and its open connections. A connection that sent nothing and had nothing being answered
    for ``keepalive_s`` is closed (aiohttp's keep-alive timeout, 75 s: idle clients cannot hold sockets forever),
    checked by one sweep every ``keepalive_s`` / 4 rather than a timer per request."""

    def __init__(self, keepalive_s: float):
        self.keepalive_s = keepalive_s
        self.live: set[Connection] = set()
        self.server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    @property
    def sockets(self):
        return self.server.sockets

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s / 4)
            self.sweep()

    def sweep(self) -> None:
        """Close the connections idle since the sweep before the last (idle for keepalive_s / 4 .. keepalive_s)."""
        for conn in list(self.live):
            busy = conn.request is not None or conn.task is not None or conn.active
            conn.idle_sweeps = 0 if busy else conn.idle_sweeps + 1
            conn.active = False
            if conn.idle_sweeps >= 4 and conn.transport is not None:
                conn.transport.close()

    def close(self) -> None:
        self.server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.live):
            if conn.transport is not None:
                conn.transport.close()

    async def wait_closed(self) -> None:
        await self.server.wait_closed()


async def start_server(on_request: OnRequest | Handler, host: str, port: int, max_body: int,
                       extra: Callable[[Request, int], Headers] | None = None,
                       ssl_context: ssl.SSLContext | None = None, keepalive_s: float = 75.0) -> HttpServer:
    """Listen on host:port (``close()`` + ``wait_closed()`` the result to stop); ``on_request(request, connection)``
    answers each request (see the module's doc; a coroutine function instead answers each in a task of its own).
    ``extra(request, status)``: headers added to every response (request id, CORS)."""
    loop = asyncio.get_running_loop()
    if asyncio.iscoroutinefunction(on_request):
        handler = on_request

        def on_request(req: Request, conn: Connection) -> None:
            conn.run(handler(req, conn))
    http = HttpServer(keepalive_s)
    http.server = await loop.create_server(lambda: Connection(on_request, max_body, extra, http.live), host, port,
                                           reuse_address=True, ssl=ssl_context, backlog=1024)
    http._sweeper = loop.create_task(http._sweep_forever())
    return http
