"""What the worker and router apps share: app construction with JSON errors, and running an app on a port."""
from __future__ import annotations

import asyncio
import gc

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from framework.serving.http.errors import CLIENT_MAX_SIZE_KEY, error_middleware

DEFAULT_CLIENT_MAX_SIZE = 8 * 1024 * 1024  # bytes; larger bodies get a 413 JSON error
SERVING_GC_THRESHOLD = 50_000  # net new container objects between young collections (Python's default: 700)


def make_app(client_max_size: int = DEFAULT_CLIENT_MAX_SIZE) -> web.Application:
    app = web.Application(client_max_size=client_max_size, middlewares=[error_middleware])
    app[CLIENT_MAX_SIZE_KEY] = client_max_size
    return app


def metrics_response(registry: CollectorRegistry) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def tune_gc_for_serving() -> None:
    """Garbage-collector settings for a process that serves many concurrent requests; process-wide, so called by
    the process's entry point once its app is built, never by code that tests share a process with.

    Python collects its youngest generation every 700 net new container objects. With 256 requests in flight that
    was hundreds of collections a second in the router, each scanning objects that in-flight requests still hold,
    and every full collection re-scanned the ~50k objects made at import: ~10% of the router's CPU
    (experiments/bench_router). ``gc.freeze()`` takes what exists now out of every later scan, and the larger
    threshold lets a collection wait for garbage rather than for concurrency; reference cycles are rare on the
    request path (~0.2 objects per request) and are still collected.
    """
    gc.freeze()
    gc.set_threshold(SERVING_GC_THRESHOLD, *gc.get_threshold()[1:])


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
