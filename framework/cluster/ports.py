"""`router.port=0`: free ports for the router and the local workers, so several clusters share one node (the Hydra
joblib, submitit and Ray launchers run several jobs per node). The kernel picks each port (bind to port 0); the
sockets are closed again before the servers bind, so another process could take a port in between: rare, and the
server's start then fails with "port in use", naming the port."""
from __future__ import annotations

import dataclasses
import socket


def free_ports(host: str, n: int) -> list[int]:
    """n distinct ports that are free on `host` now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def assign_free_ports(cfg) -> None:
    """With router.port=0, set router.port and (local workers, no cluster.worker_ports given) cluster.worker_ports
    to free ports, in place. Any other port is left as asked."""
    if cfg.router.port != 0:
        return
    local = 0 if cfg.cluster.workers or cfg.cluster.worker_ports else max(cfg.cluster.instances, 0)
    ports = free_ports(cfg.router.host, 1 + local)
    cfg.router.port = ports[0]
    if local:
        cfg.cluster.worker_ports = ports[1:]


def with_free_port(router_cfg):
    """The router config itself, or a copy on a free port when its port is 0."""
    if router_cfg.port != 0:
        return router_cfg
    return dataclasses.replace(router_cfg, port=free_ports(router_cfg.host, 1)[0])
