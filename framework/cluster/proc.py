"""What runs inside each process `framework.cluster.cluster.Cluster` starts: one engine instance behind the worker
HTTP app, or the router. Started as `python -m framework.cluster.proc {worker,router} STATUS_FD`, with a
pickled spec on stdin; it reports one JSON line on STATUS_FD ({"event": "ready"} or {"event": "error", ...}) and then
serves until SIGTERM/SIGINT, or until its parent dies (PR_SET_PDEATHSIG), so it never outlives the cluster.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class WorkerSpec:
    model: Any
    engine: Any
    parallel: Any
    moe: Any
    seed: int
    host: str
    port: int
    name: str                      # "worker 0 (http://127.0.0.1:30001)": for messages
    kv_block_size: int = 0         # > 0: publish the radix cache's KV events in blocks of this many tokens


@dataclass
class RouterSpec:
    policy: Any                    # the routing plugin's own Config
    service: Any                   # framework.serving.router.config.RouterServiceConfig
    worker_urls: list[str]
    seed: int
    name: str = "router"


def open_worker_engine(spec: WorkerSpec):
    """The worker's EngineHandle: one engine instance of `parallel.size` ranks (framework.instance.client)."""
    import torch
    torch.set_num_threads(1)
    from framework.instance.rank_loop import InstanceSpec
    from framework.instance.client import open_engine
    return open_engine(InstanceSpec(spec.model, spec.engine, spec.parallel, spec.moe, spec.seed,
                                    kv_events_block_size=spec.kv_block_size))


async def _serve(role: str, spec, report) -> None:
    from framework.serving.http.server_base import start_app, tune_gc_for_serving
    client = publisher = None
    if role == "worker":   # (the spec's class is framework.cluster.proc's, not this __main__'s)
        from framework.serving.worker import create_worker_app
        client = open_worker_engine(spec)
        info = {}
        if spec.kv_block_size:
            from framework.kv_events.worker import publish_cache_events
            publisher, info["kv_events"] = publish_cache_events(client, spec.host, spec.kv_block_size)
        app, host, port = create_worker_app(client, extra_info=info), spec.host, spec.port
    else:
        from framework.core.registry import ROUTING
        from framework.serving.router.service import Router   # on its own HTTP server (Router.listen), not aiohttp's
        policy = ROUTING.get(spec.policy.name)(spec.policy, spec.seed)
        cfg = spec.service
        app, host, port = Router(policy, spec.worker_urls, cfg, spec.seed), cfg.host, cfg.port
        tune_gc_for_serving()        # a long-lived router: no GC pauses over the objects in-flight requests hold
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            runner = await (app.listen() if role == "router" else start_app(app, host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        report({"event": "ready", "pid": os.getpid()})
        await stop.wait()
        await runner.cleanup()
    finally:
        if client is not None:
            client.close()
        if publisher is not None:
            publisher.close()


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the parent dies, even by SIGKILL (Linux); elsewhere the parent's cleanup must do."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:        # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _uvloop_run():
    """uvloop's event loop for the router: a quarter less CPU per request (experiments/bench_router)."""
    import uvloop
    return uvloop.run


def main(argv: list[str]) -> int:
    role, status_fd = argv[0], int(argv[1])
    logging.basicConfig(level=logging.WARNING, format=f"[{role} %(process)d] %(levelname)s %(name)s: %(message)s")

    def report(msg: dict) -> None:
        # one write under PIPE_BUF so the parent reads whole lines: shorten the fields, never the JSON itself
        msg = {k: (v[-1200:] if k == "traceback" else v[:1200]) if isinstance(v, str) else v for k, v in msg.items()}
        data = (json.dumps(msg) + "\n").encode()
        try:
            os.write(status_fd, data)
        except OSError:
            pass

    try:
        parent_pid, spec = pickle.load(sys.stdin.buffer)
        _die_with_parent(parent_pid)
        (_uvloop_run() if role == "router" else asyncio.run)(_serve(role, spec, report))
        return 0
    except Exception as e:  # noqa: BLE001 - whatever stops startup goes to the parent as one message
        expected = isinstance(e, (OSError, ValueError, KeyError))     # bad config, busy port: the message says it
        report({"event": "error", "message": f"{type(e).__name__}: {e}",
                "traceback": "" if expected else traceback.format_exc()})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
