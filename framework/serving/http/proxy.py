"""HTTP proxy mechanics the router needs, apart from routing: which headers pass through, and Retry-After."""
from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

from multidict import CIMultiDict, CIMultiDictProxy

WORKER_HEADER = "X-Servelab-Worker"  # names the worker that answered (or failed last)
ROUTE_HEADER = "X-Servelab-Route"    # the decision behind it: "<reason>; estimate=<cached>; of=<request size>"
REQUEST_ID_HEADER = "X-Request-Id"   # set when the client sent none; the worker's id for /abort_request
# RFC 9110 7.6.1 hop-by-hop fields, plus what the proxy's own HTTP layer sets for each side
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
NOT_RETURNED = HOP_BY_HOP | {"content-length", "date", "server"}
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is honoured for this long (a worker must not park itself forever)
RETRY_SAME_WORKER = (429, 503)  # busy, not broken: the one answer worth trying the same worker again for


def route_header(decision) -> str:
    """The ROUTE_HEADER value for a ``RoutingDecision``: its reason and the policy's estimate of the cached part, in
    the policy's unit (tokens for the KV-view policies, characters for the text trees), over the request's size."""
    return f"{decision.reason}; estimate={decision.matched_chars}; of={decision.request_chars}"


def dropped(connection, base: frozenset):
    """The header names a proxy drops: ``base`` and the fields the Connection header (``connection``, str or bytes,
    None when absent) names, hop-by-hop too. Names in lower case, the same type as ``connection``'s."""
    if not connection:
        return base
    return base | {t.strip().lower() for t in connection.split("," if isinstance(connection, str) else b",")}


def pass_headers(headers: CIMultiDictProxy, drop: frozenset[str]) -> CIMultiDict:
    """``headers`` without ``drop`` and without the fields the Connection header names (hop-by-hop too)."""
    drop = dropped(headers.get("Connection"), drop)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def retry_after_s(value: str | None, now_unix: float | None = None) -> float | None:
    """A Retry-After field (delay-seconds or an HTTP date) in seconds from now, capped; None when absent or bad."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - (time.time() if now_unix is None else now_unix)
        except (TypeError, ValueError):
            return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))
