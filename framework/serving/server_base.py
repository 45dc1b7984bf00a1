"""What the worker and router apps share: app construction with JSON errors, and running an app on a port."""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from framework.serving.errors import CLIENT_MAX_SIZE_KEY, error_middleware

DEFAULT_CLIENT_MAX_SIZE = 8 * 1024 * 1024  # bytes; larger bodies get a 413 JSON error


def make_app(client_max_size: int = DEFAULT_CLIENT_MAX_SIZE) -> web.Application:
    app = web.Application(client_max_size=client_max_size, middlewares=[error_middleware])
    app[CLIENT_MAX_SIZE_KEY] = client_max_size
    return app


def metrics_response(registry: CollectorRegistry) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start ``app`` on host:port and return its runner (``await runner.cleanup()`` stops it).

    ``handler_cancellation`` cancels a handler when its client disconnects, so an abandoned request stops its
    generation (worker) or its upstream call (router) instead of running to the end.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def serve_forever(app: web.Application, host: str, port: int) -> None:
    """Serve until the calling task is cancelled, then shut down cleanly."""
    runner = await start_app(app, host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
