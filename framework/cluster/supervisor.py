"""Keeps a local cluster serving while its processes die: a thread that watches every child of a `Cluster`.

A worker that exits is taken out of the router at once (``POST /remove_worker``: no request waits for the next
health check, and its cache estimate goes with it), started again on the same port after a backoff that doubles
with each restart in the window, and added back (``POST /add_worker``) once it answers ``/health``. A router that
exits is started again in front of the workers that are up. A process restarted ``max_restarts`` times within
``restart_window_s`` is given up on; the cluster keeps serving with the rest, and ``fatal`` says when nothing is
left to serve with (no worker, or no router). Only `Cluster.stop` ends the watch.

The children it starts die with this thread (PR_SET_PDEATHSIG, see cluster_proc): it runs until the cluster stops.
"""
from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.parse
from collections import deque
from dataclasses import dataclass, field

from framework.cluster.processes import http_json

log = logging.getLogger("servelab.cluster")
POLL_S = 0.05                # how often the children are looked at: a death is noticed within this
MAX_BACKOFF_S = 30.0
CONTROL_TIMEOUT_S = 10.0     # the router's remove_worker drains: a dead worker's requests fail at once


@dataclass
class _Slot:
    """One supervised process: a worker (``index`` >= 0) or the router (``index`` -1)."""
    index: int
    restarts: deque = field(default_factory=deque)  # when it was restarted, within the window
    due: float | None = None       # backing off: restart at this time.monotonic()
    starting: object = None        # the _Child being started
    started_at: float = 0.0
    given_up: bool = False

    @property
    def is_router(self) -> bool:
        return self.index < 0


class Supervisor:
    def __init__(self, cluster):
        self.cluster, self.cfg = cluster, cluster.cfg.cluster
        self.slots = [_Slot(i) for i in range(len(cluster.workers))] + [_Slot(-1)]  # no slot for external workers
        self.counts = {"worker_restarts": 0, "router_restarts": 0, "workers_given_up": 0}
        self.fatal: str | None = None
        self._router_fronts: list[str] = []  # the workers a restarted router was started with
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="servelab-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def starting(self) -> list:
        """Children being started right now (stop() must end them too)."""
        return [s.starting for s in self.slots if s.starting is not None]

    def _run(self) -> None:
        while not self._halt.wait(POLL_S):
            with self.cluster.lock:
                for slot in self.slots:
                    if self._halt.is_set():
                        return
                    try:
                        self._look_at(slot, time.monotonic())
                    except Exception:  # the watch must go on whatever one child did
                        log.exception("supervising %s failed", self._name(slot))

    # -- one child ------------------------------------------------------------------------------------------------
    def _look_at(self, slot: _Slot, now: float) -> None:
        if slot.given_up:
            return
        if slot.starting is not None:
            self._follow_start(slot, now)
        elif slot.due is not None:
            if now >= slot.due:
                slot.due = None
                if slot.is_router:
                    self._router_fronts = self._up_urls()
                    slot.starting = self.cluster.spawn_router(self._router_fronts or self.cluster.worker_urls)
                else:
                    slot.starting = self.cluster.spawn_worker(slot.index)
                slot.started_at = now
                self.counts["router_restarts" if slot.is_router else "worker_restarts"] += 1
        else:
            child = self._current(slot)
            if child is not None and child.popen.poll() is not None:
                self._exited(slot, f"{child.name} exited with status {child.popen.returncode}", now)

    def _follow_start(self, slot: _Slot, now: float) -> None:
        child = slot.starting
        try:
            ready = self.cluster.poll_ready(child)
        except Exception as e:  # noqa: BLE001 - ClusterError: it failed to start; the message says why
            ready, failure = False, str(e)
        else:
            failure = None
            if not ready and now - slot.started_at > self.cluster.cfg.cluster.startup_timeout_s:
                failure = f"{child.name} did not come up within cluster.startup_timeout_s"
        if failure is None and not (ready and self.cluster.answers_health(child.url)):
            return
        slot.starting = None
        if failure is not None:
            self.cluster.end_children([child])
            self._exited(slot, failure, now, in_router=False)
            return
        self.cluster.install(slot.index, child)
        if not slot.is_router:
            self._tell_router("add_worker", child.url)
        else:  # workers that came back while it was starting
            for url in set(self._up_urls()) - set(self._router_fronts):
                self._tell_router("add_worker", url)
        log.warning("%s is serving again (restart %d within %gs)", child.name, len(slot.restarts),
                    self.cfg.restart_window_s)

    def _exited(self, slot: _Slot, why: str, now: float, in_router: bool = True) -> None:
        name = self._name(slot)
        if not slot.is_router and in_router:
            self._tell_router("remove_worker", self.cluster.worker_urls[slot.index])
        while slot.restarts and now - slot.restarts[0] > self.cfg.restart_window_s:
            slot.restarts.popleft()
        if len(slot.restarts) >= self.cfg.max_restarts:
            slot.given_up = True
            log.error("%s; it was restarted %d times within %gs (cluster.max_restarts): giving up on it", why,
                      len(slot.restarts), self.cfg.restart_window_s)
            if slot.is_router:
                self.fatal = f"the router could not be kept up: {why}"
            else:
                self.counts["workers_given_up"] += 1
                if all(s.given_up for s in self.slots if not s.is_router):
                    self.fatal = f"every worker could not be kept up; last: {why}"
            return
        slot.restarts.append(now)
        delay = min(MAX_BACKOFF_S, self.cfg.restart_backoff_s * 2 ** (len(slot.restarts) - 1))
        slot.due = now + delay
        log.warning("%s; restarting %s in %.1fs", why, name, delay)

    # -- helpers --------------------------------------------------------------------------------------------------
    def _up_urls(self) -> list[str]:
        """The workers serving now (external ones: all of them)."""
        urls = self.cluster.worker_urls
        if not self.cluster.workers:
            return list(urls)
        return [u for s, u in zip(self.slots[:-1], urls) if s.due is None and s.starting is None and not s.given_up]

    def _current(self, slot: _Slot):
        return self.cluster.router if slot.is_router else self.cluster.workers[slot.index]

    def _name(self, slot: _Slot) -> str:
        return "the router" if slot.is_router else f"worker {slot.index} ({self.cluster.worker_urls[slot.index]})"

    def _tell_router(self, action: str, url: str) -> None:
        target = f"{self.cluster.router_url}/{action}?url={urllib.parse.quote(url, safe='')}"
        try:
            http_json("POST", target, timeout=CONTROL_TIMEOUT_S, data=b"")
        except (OSError, ValueError) as e:  # the router is down too: it starts again with the workers that are up
            log.warning("could not %s %s at the router: %s", action.replace("_", " "), url, e)
