"""Helpers for the cluster tests: real clusters on loopback (worker and router processes of framework.cluster.cluster),
ports, and the process tree read from /proc."""
from __future__ import annotations

import os
from pathlib import Path

from framework.core import ports


ROOT = Path(__file__).resolve().parents[2]


def free_port_block(n: int) -> int:
    """A base port with base .. base+n-1 all free (the router takes base, workers the next ones), chosen outside the
    kernel's ephemeral range so that no outgoing connection takes one before the cluster's children bind them."""
    return ports.free_port_block("127.0.0.1", n)


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir
    from framework.config import register_configs, to_objects
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_objects(hydra_compose("config", overrides=["logger.mode=disabled", *overrides]))


def cluster_cfg(instances: int = 2, *overrides: str):
    port = free_port_block(instances + 1)
    return compose(f"cluster.instances={instances}", f"router.port={port}", "engine.kv_budget_mb=1", *overrides)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
