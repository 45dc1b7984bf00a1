"""The router behind an aiohttp app: the same ``Router.handle`` as on the router's own server (server.py), for code
that serves it on aiohttp's (an aiohttp test server, an app that mounts it). Slower (aiohttp's request and response
objects, ~2-3x the CPU per request: experiments/bench_router); processes that serve only the router use
``service.start_router``."""
from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from framework.serving.http.server_base import make_app
from framework.serving.router.server import Answering, Headers, Request

ROUTER_KEY = web.AppKey("router")  # app[ROUTER_KEY]: the service.Router it serves


def _multidict(headers: Headers) -> CIMultiDict:
    return CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)


class AiohttpAnswer(Answering):
    """``Answering`` on an aiohttp request: ``response`` is what the handler returns."""

    def __init__(self, web_request: web.Request, req: Request, extra):
        self.web_request, self.req, self.extra = web_request, req, extra
        self.response: web.StreamResponse | None = None
        self._stream: web.StreamResponse | None = None

    def send(self, status: int, headers: Headers, body: bytes = b"") -> None:
        self.response = web.Response(status=status, body=body,
                                     headers=_multidict([*headers, *self.extra(self.req, status)]))

    def start(self, status: int, headers: Headers) -> None:
        self.response = self._stream = web.StreamResponse(
            status=status, headers=_multidict([*headers, *self.extra(self.req, status)]))

    async def write(self, chunk: bytes) -> None:
        if not self._stream.prepared:
            await self._stream.prepare(self.web_request)
        await self._stream.write(chunk)

    async def end(self) -> None:
        if not self._stream.prepared:
            await self._stream.prepare(self.web_request)
        await self._stream.write_eof()


def router_app(router) -> web.Application:
    """``router`` (a service.Router) as an aiohttp app; ``app[ROUTER_KEY]`` is the router."""
    app = make_app(router.cfg.client_max_size)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        raw = [(k.lower(), v) for k, v in request.raw_headers]
        req = Request(request.method, request.path, request.query_string, raw, {k.lower(): v for k, v in raw}, body,
                      request.keep_alive)
        answer = AiohttpAnswer(request, req, router.extra_headers)
        await router.handle(req, answer)
        return answer.response

    app.router.add_route("*", "/{tail:.*}", handle)
    return app
