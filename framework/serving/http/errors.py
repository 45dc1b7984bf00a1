"""JSON errors for every HTTP failure, shared by the worker and the router.

Every 4xx/5xx leaves as ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape): pydantic validation
errors name the field path, aiohttp's own 404/405/413 are converted by ``error_middleware``, and an unexpected
exception becomes a 500 that is logged while the service keeps serving.
"""
from __future__ import annotations

import json
import logging
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
CLIENT_MAX_SIZE_KEY = web.AppKey("client_max_size", int)

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 404: "not_found_error", 405: "method_not_allowed_error",
    409: "conflict_error", 413: "request_too_large_error", 500: "internal_error", 502: "upstream_error",
    503: "service_unavailable_error", 504: "upstream_timeout_error",
}


class ApiError(Exception):
    """An error with an HTTP status; ``param`` is the offending field path when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "internal_error")
        self.headers = headers  # sent with the response (e.g. Retry-After)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self, headers: dict | None = None) -> web.Response:
        return web.json_response(self.to_dict(), status=self.status, headers={**(self.headers or {}), **(headers or {})})


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "body"


def validation_error(exc: ValidationError) -> ApiError:
    """One 400 naming every bad field: ``"sampling_params.top_p: Input should be less than or equal to 1"``."""
    parts, first = [], None
    for err in exc.errors(include_url=False):
        if err["type"] == "json_invalid":
            return ApiError(400, f"body: malformed JSON ({err['msg']})", param="body")
        path = _field_path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unsupported field"
        parts.append(f"{path}: {msg}")
        first = first or path
    return ApiError(400, "; ".join(parts), param=first)


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate raw JSON bytes against ``model`` in one pass; raise ApiError(400) naming the fields."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    if status == 404:
        msg = f"no route {request.method} {request.path}"
    elif status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        msg = f"method {request.method} not allowed on {request.path}; allowed: {', '.join(allowed)}"
    elif status == 413:
        limit = request.app.get(CLIENT_MAX_SIZE_KEY, "configured")
        msg = f"body: request body exceeds the limit of {limit} bytes"
    else:
        msg = exc.text or exc.reason
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return ApiError(status, msg, param="body" if status == 413 else None).response(headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc, request)
    except (ConnectionResetError, BrokenPipeError):
        raise  # the client went away; nothing to answer
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"internal error while handling {request.method} {request.path}").response()


def json_bytes(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
