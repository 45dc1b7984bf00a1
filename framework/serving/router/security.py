"""Who may use the router, with sglang-router 0.3.2's flags and answers (sgl-router src/middleware.rs, src/auth):

- ``api_key`` (``--api-key``): the generation routes and /v1/models, /get_server_info want
  ``Authorization: Bearer <api_key>`` (compared in constant time); otherwise 401. /health and /metrics stay open.
- ``control_plane_api_keys`` (``--control-plane-api-keys``, each ``id:name:role:key``, role ``admin`` or ``user``):
  the worker admin endpoints (/add_worker, /remove_worker, /flush_cache, /router_stats/reset) want an admin key, the
  read-only ones (/list_workers, /router_stats) any of them; 401 without a valid key (``WWW-Authenticate: Bearer
  realm="control-plane"``), 403 with a user key on an admin endpoint. Without control keys the control plane takes
  the ``api_key`` when there is one. Each control action leaves an audit line (logger ``servelab.router.audit``,
  ``control_plane_audit_enabled``): who, what, on which worker, allowed or denied, the request id.
- the request id: the first of ``request_id_headers`` the client sent (default, as SGLang: x-request-id,
  x-correlation-id, x-trace-id, request-id), else a new one; it goes to the worker as X-Request-Id (what
  /abort_request names) and back to the client as X-Request-Id on every answer.
- CORS (``cors_allowed_origins``, an origin or ``*`` each): a listed Origin gets Access-Control-Allow-Origin and a
  preflight (OPTIONS) is answered with SGLang's methods, headers and max-age. None listed (the default): no CORS
  headers (SGLang 0.3.2 then allows every origin).
"""
from __future__ import annotations

import hmac
import logging
import random
from dataclasses import dataclass

from framework.serving.http.errors import ApiError

audit_log = logging.getLogger("servelab.router.audit")
audit_log.setLevel(logging.INFO)  # audit lines show under a process's WARNING default (framework/cluster/proc.py)
DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
ROLES = ("admin", "user")
_PREFLIGHT = [(b"Access-Control-Allow-Methods", b"GET,POST,OPTIONS"),
              (b"Access-Control-Allow-Headers", b"content-type,authorization"), (b"Access-Control-Max-Age", b"3600")]


@dataclass(frozen=True)
class ControlKey:
    id: str
    name: str
    role: str
    key: bytes


def parse_control_keys(specs) -> list[ControlKey]:
    """``id:name:role:key`` strings -> ControlKey; a ValueError naming the bad one and the format otherwise."""
    keys = []
    for spec in specs or ():
        parts = str(spec).split(":", 3)
        if len(parts) != 4 or not parts[3] or parts[2] not in ROLES:
            raise ValueError(f"router.control_plane_api_keys: {spec!r} is not 'id:name:role:key' with role in "
                             f"{ROLES} (e.g. 'ops:Operations:admin:s3cret')")
        keys.append(ControlKey(parts[0], parts[1], parts[2], parts[3].encode()))
    return keys


def _bearer(value: bytes | None) -> bytes | None:
    if value is None or not value.startswith(b"Bearer "):
        return None
    return value[7:]


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


class Guard:
    def __init__(self, api_key: str | None, control_keys: list[ControlKey], audit: bool,
                 request_id_headers, cors_origins):
        self.api_key = api_key.encode() if api_key else None
        self.control_keys, self.audit = control_keys, audit
        self.rid_headers = tuple(h.lower().encode() for h in (request_id_headers or DEFAULT_REQUEST_ID_HEADERS))
        self._rid_names = frozenset(self.rid_headers)
        origins = [o.encode() for o in cors_origins or ()]
        self.cors_any, self.cors = b"*" in origins, frozenset(origins)
        self.cors_on = bool(origins)
        # ids: a random 64-bit prefix per router (seeded from the OS: differs across processes and runs) and a
        # counter, 32 hex digits as uuid4().hex; a third of getrandbits(128)'s cost on every request
        self._id_prefix, self._id_n = b"%016x" % random.Random().getrandbits(64), 0

    def request_id(self, lower: dict[bytes, bytes]) -> bytes:
        if not self._rid_names.isdisjoint(lower):  # (most clients send none: one set check, no loop)
            for name in self.rid_headers:
                rid = lower.get(name)
                if rid:
                    return rid
        self._id_n = n = self._id_n + 1
        return b"%s%016x" % (self._id_prefix, n)

    def data_plane(self, lower: dict[bytes, bytes]) -> None:
        if self.api_key is not None:
            token = _bearer(lower.get(b"authorization"))
            if token is None or not _same(token, self.api_key):
                raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <router.api_key>'",
                               type="authentication_error")

    def control_plane(self, lower: dict[bytes, bytes], method: str, path: str, resource: str | None, rid: bytes,
                      admin: bool) -> None:
        """Allow or refuse a control request (ApiError 401/403), with its audit line."""
        if not self.control_keys and self.api_key is None:
            self._audit("anonymous", "none", method, path, resource, "allowed (no keys configured)", rid)
            return
        token = _bearer(lower.get(b"authorization"))
        who = None
        if token is not None:
            if self.control_keys:
                who = next((k for k in self.control_keys if _same(token, k.key)), None)
            elif _same(token, self.api_key):
                who = ControlKey("api_key", "router.api_key", "admin", self.api_key)
        if who is None:
            self._audit("unauthenticated", "none", method, path, resource, "denied", rid)
            raise ApiError(401, "control plane: missing or invalid Authorization header (a Bearer key of "
                                "router.control_plane_api_keys)", type="authentication_error",
                           headers={"WWW-Authenticate": 'Bearer realm="control-plane"'})
        if admin and who.role != "admin":
            self._audit(who.id, who.role, method, path, resource, "denied (role)", rid)
            raise ApiError(403, f"control plane: key {who.id!r} has role {who.role!r}; {path} needs 'admin'",
                           type="permission_error")
        self._audit(who.id, who.role, method, path, resource, "allowed", rid)

    def _audit(self, principal: str, role: str, method: str, path: str, resource: str | None, outcome: str,
               rid: bytes) -> None:
        if self.audit:
            audit_log.info("control_plane_audit principal=%s role=%s method=%s path=%s resource=%s outcome=%s "
                           "request_id=%s", principal, role, method, path, resource, outcome, rid.decode("latin-1"))

    def cors_headers(self, lower: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        origin = lower.get(b"origin")
        if origin is None or not (self.cors_any or origin in self.cors):
            return []
        return [(b"Access-Control-Allow-Origin", origin), (b"Vary", b"Origin"),
                (b"Access-Control-Expose-Headers", b"x-request-id")]

    def preflight(self, lower: dict[bytes, bytes]) -> list[tuple[bytes, bytes]] | None:
        """Headers answering a CORS preflight, or None when it is not one (or not for an allowed origin)."""
        if not self.cors_on or b"access-control-request-method" not in lower:
            return None
        return _PREFLIGHT if self.cors_headers(lower) else None  # the origin's own headers: cors_headers
