"""The router's headers as bytes, both ways, and the answer given back when every attempt failed. The rules are
framework/serving/http/proxy.py's (which headers are hop-by-hop, what the proxy sets itself), in the byte form the
router's own server and client carry (server.py, upstream.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from framework.serving.http.errors import ApiError
from framework.serving.http.proxy import NOT_FORWARDED, NOT_RETURNED, REQUEST_ID_HEADER, WORKER_HEADER, dropped
from framework.serving.router.server import Answering, Headers, Request

_NOT_FORWARDED = frozenset(h.encode() for h in NOT_FORWARDED) | {REQUEST_ID_HEADER.lower().encode()}
_NOT_RETURNED = frozenset(h.encode() for h in NOT_RETURNED) | {REQUEST_ID_HEADER.lower().encode()}
_RID = REQUEST_ID_HEADER.encode()


_passed: dict[tuple, bytes] = {}  # a client's header list -> its end-to-end lines: clients repeat theirs
_PASSED_MAX = 4096


def forwarded_head(req: Request, length: int) -> bytes:
    """The header lines sent to a worker (names in lower case, as the server parsed them): the client's end-to-end
    ones, X-Request-Id (the router's id for the request, what /abort_request names), a Content-Type when the client
    gave none, and Content-Length."""
    key = tuple(req.headers)
    passed = _passed.get(key)
    if passed is None:
        drop = dropped(req.lower.get(b"connection"), _NOT_FORWARDED)
        passed = b"".join(b"%s: %s\r\n" % kv for kv in req.headers if kv[0] not in drop)
        if b"content-type" not in req.lower:
            passed += b"content-type: application/json\r\n"
        if len(_passed) >= _PASSED_MAX:
            _passed.clear()
        _passed[key] = passed
    return b"%s%s: %s\r\ncontent-length: %d\r\n\r\n" % (passed, _RID, req.rid, length)


def returned_headers(up) -> Headers:
    """A worker's end-to-end response headers (the request id is the router's, added to every answer)."""
    drop = dropped(up.lower.get(b"connection"), _NOT_RETURNED)
    return [kv for kv in up.headers if kv[0] not in drop]


_returned: dict[tuple, bytes] = {}  # a worker's header list -> its end-to-end lines: a worker repeats its own


def returned_lines(up) -> bytes:
    """``returned_headers`` as header lines, each ending in CRLF."""
    key = tuple(up.headers)
    lines = _returned.get(key)
    if lines is None:
        if len(_returned) >= _PASSED_MAX:  # (Date changes every second: old keys go in bulk)
            _returned.clear()
        lines = _returned[key] = b"".join([b"%s: %s\r\n" % kv for kv in returned_headers(up)])
    return lines


def judged(up) -> tuple[bool, bool]:
    """From a worker's response head (upstream.UpstreamResponse): (worth another attempt: 408, 429, 5xx; passed on as
    it streams: an event stream or a body of no stated length)."""
    status = up.status
    if status in (408, 429) or status >= 500:
        return True, False
    return False, up.content_type() == b"text/event-stream" or up.content_length() is None


@dataclass
class Failed:
    """An attempt that did not give the client its answer: the worker's own error response (``status``, ``body``,
    ``headers``) or a transport error / timeout (``status`` None). ``retriable``: another attempt may be made."""
    worker: object  # the WorkerState it failed on
    message: str
    status: int | None = None
    body: bytes = b""
    headers: Headers = field(default_factory=list)
    timeout: bool = False
    retriable: bool = True
    retry_after: float | None = None

    def send(self, conn: Answering, attempts: int) -> None:
        worker = (WORKER_HEADER.encode(), self.worker.url.encode())
        if self.status is not None:
            conn.send(self.status, [*self.headers, worker], self.body)
            return
        status = 504 if self.timeout else 502
        conn.send_error(ApiError(status, f"{attempts} attempt(s) failed; last: {self.message}"), [worker])
