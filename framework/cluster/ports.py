"""`router.port=0`: free ports for the router and the local workers, so several clusters share one node (the Hydra
joblib, submitit and Ray launchers run several jobs per node). The router and the workers are child processes, so
their ports are chosen here, before they bind: outside the kernel's ephemeral range (framework.core.ports), where no
outgoing connection can take a port between the choice and the bind. Another server may still take one first (rare):
the child's start then fails with "port in use", naming the port."""
from __future__ import annotations

import dataclasses

from framework.core.ports import free_ports


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
