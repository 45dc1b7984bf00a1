"""A local serving cluster: N engine instances as HTTP workers behind the router, each in its own process.

`Cluster` starts the workers (each `python -m framework.cluster.proc worker`, one engine instance: a single
rank, or `parallel.size` ranks through framework.instance.rank_loop), waits until each answers /health, then starts the
router process (`router=` policy) in front of them -- or in front of `cluster.workers`, URLs of servers started
elsewhere (servelab, SGLang or vLLM; those not up yet join when they are). Every child leads its own process group
(an instance's ranks join it) and dies with this process; `stop()` (also at exit, on SIGTERM, on Ctrl-C, on any
failure) signals each group, waits, then kills what is left, so no process outlives the cluster. While it runs, a
`Supervisor` (cluster.restart_workers) restarts a worker or router that dies (see supervisor.py).

framework/runs/bench.py drives the workload through it (figures.py: the cache hit rate the *workers* measured,
per-worker counts, load imbalance, the router's decision time, retries, restarts and its own estimate of the hit
rate); framework/runs/serve.py keeps it up until Ctrl-C or SIGTERM. The cluster's children die with the thread that started them (PR_SET_PDEATHSIG): start a Cluster from a thread that
outlives it (the main thread); restarted children are the supervisor thread's, which lives as long as the cluster.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import random
import signal
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

from framework.core.registry import ROUTING
from framework.contracts.routing import KV_EVENTS
from framework.cluster.proc import RouterSpec, WorkerSpec
from framework.cluster.ports import assign_free_ports, with_free_port
from framework.cluster.processes import (Child, check_port_free, http_json, raise_system_exit, signal_group, spawn,
                                         terminate, wait_ready)
from framework.core.errors import ClusterError
from framework.core.ports import free_ports
from framework.engine.config import ROLES, Role
from framework.serving.router.config import RouterImpl, split_router_config
from framework.cluster.supervisor import Supervisor

log = logging.getLogger("servelab.cluster")


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def _split(router_cfg):
    try:
        return split_router_config(router_cfg)
    except ValueError as e:
        raise ClusterError(str(e)) from None


def kv_block_size(cc, policy_cfg) -> int:
    """The block size workers publish KV events in (0: none), from the cluster config ``cc``: on with cluster.kv_events,
    or for a policy that follows them (whose router.block_size must be the workers'). The simulator asks the same."""
    policy = ROUTING.get(policy_cfg.name)
    follows = KV_EVENTS in policy.subscriptions
    if not (cc.kv_events or follows):
        return 0
    if cc.kv_block_size < 1:
        raise ClusterError(f"cluster.kv_block_size={cc.kv_block_size} must be >= 1")
    policy_size = policy.kv_block_size(policy_cfg) or cc.kv_block_size
    if follows and policy_size != cc.kv_block_size:
        raise ClusterError(f"router.block_size={policy_size} but the workers publish blocks of "
                           f"cluster.kv_block_size={cc.kv_block_size} tokens: make them equal")
    return cc.kv_block_size


def instance_roles(cc, instances: int, engine_role: str = Role.mixed) -> list[Role]:
    """Each local instance's role from cluster.roles (empty: every one mixed). A disaggregated cluster needs at least
    one prefill and one decode instance."""
    if engine_role != Role.mixed:
        raise ClusterError(f"engine.role={engine_role} would give every local instance one role; set the roles per "
                           f"instance with cluster.roles=[prefill,decode,...] instead")
    if not cc.roles:
        return [Role.mixed] * instances
    if cc.workers:
        raise ClusterError("cluster.roles sets the roles of local instances; servers started elsewhere "
                           "(cluster.workers) set their own (engine.role)")
    if len(cc.roles) != instances or any(r not in ROLES for r in cc.roles):
        raise ClusterError(f"cluster.roles={list(cc.roles)}: give one role per instance (cluster.instances="
                           f"{instances}), each one of {', '.join(ROLES)}")
    roles = [Role(r) for r in cc.roles]
    if set(roles) != {Role.mixed} and set(roles) != {Role.prefill, Role.decode}:
        raise ClusterError(f"cluster.roles={list(cc.roles)}: disaggregated serving needs at least one prefill and "
                           f"one decode instance, and no mixed one (a P/D router sends every request to a pair)")
    return roles


class Cluster:
    def __init__(self, cfg):
        assign_free_ports(cfg)             # router.port=0: free ports for the router and the local workers
        self.cfg = cfg
        self.policy_cfg, self.service = _split(cfg.router)
        cc = cfg.cluster
        host, port = self.service.host, self.service.port
        self.router_url = f"http://{_url_host(host)}:{port}"
        self.external = [u.rstrip("/") for u in cc.workers]
        if self.external:
            self.worker_ports: list[int] = []
            self.worker_urls = list(self.external)
        else:
            if cc.instances < 1:
                raise ClusterError(f"cluster.instances={cc.instances}: need at least 1 (or cluster.workers=[urls])")
            ports = list(cc.worker_ports) or [port + 1 + i for i in range(cc.instances)]
            if len(ports) != cc.instances:
                raise ClusterError(f"cluster.worker_ports has {len(ports)} ports for cluster.instances="
                                   f"{cc.instances}; give one port per instance, or none (router.port+1, +2, ...)")
            if len(set(ports + [port])) != len(ports) + 1:
                raise ClusterError(f"ports must differ: router.port={port}, cluster.worker_ports={ports}")
            self.worker_ports = ports
            self.worker_urls = [f"http://{_url_host(host)}:{p}" for p in ports]
        self.roles = instance_roles(cc, len(self.worker_ports), cfg.engine.role)
        # each prefill instance's bootstrap port (where decode instances ask it for a room's KV)
        self.bootstrap_ports = {i: p for i, p in zip([i for i, r in enumerate(self.roles) if r is Role.prefill],
                                                     free_ports(self.service.host, self.roles.count(Role.prefill)))}
        # (servelab's router learns the roles from each worker's /server_info; sglang-router is told them: pd_workers)
        self.kv_block_size = kv_block_size(cc, self.policy_cfg)
        if cc.startup_timeout_s <= 0:
            raise ClusterError(f"cluster.startup_timeout_s={cc.startup_timeout_s} must be > 0")
        if cc.max_restarts < 0 or cc.restart_backoff_s < 0 or cc.restart_window_s <= 0:
            raise ClusterError(f"cluster.max_restarts={cc.max_restarts} and cluster.restart_backoff_s="
                               f"{cc.restart_backoff_s} must be >= 0, cluster.restart_window_s="
                               f"{cc.restart_window_s} > 0")
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.supervisor: Supervisor | None = None
        self.peer = None                   # router.impl=sglang: the SglangRouter (peer_router.py)
        self.metrics_url = self.router_url + "/metrics"
        self.lock = threading.RLock()  # the supervisor's changes against start_router's and stop's
        self._old_sigterm = None

    # -- lifetime -----------------------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.start_workers()
        self.start_router()
        if self.cfg.cluster.restart_workers:
            self.supervisor = Supervisor(self)
            self.supervisor.start()

    def start_workers(self) -> None:
        self._arm_cleanup()
        if self.external:
            return             # the router adds each as soon as it answers /health
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout_s
        for i, p in enumerate(self.worker_ports):
            check_port_free(self.service.host, p, f"worker {i}", "leave router.port and cluster.worker_ports unset "
                            "(router.port=0, the default: free ports)")
        self.workers = [self.spawn_worker(i) for i in range(len(self.worker_ports))]
        wait_ready(self.workers, deadline, self.cfg.cluster.startup_timeout_s)
        self._wait_health(self.worker_urls, deadline)

    def spawn_worker(self, i: int) -> Child:
        c, url = self.cfg, self.worker_urls[i]
        engine, role = c.engine, self.roles[i]
        if role is not Role.mixed:
            engine = dataclasses.replace(engine, role=role, disaggregation_host=_url_host(self.service.host),
                                         disaggregation_bootstrap_port=self.bootstrap_ports.get(i, 0))
        spec = WorkerSpec(c.model, engine, c.parallel, c.moe, c.seed, self.service.host, self.worker_ports[i],
                          f"worker {i} ({url}{'' if role is Role.mixed else ', ' + role})", self.kv_block_size)
        return spawn("worker", spec, spec.name, url)

    def spawn_router(self, worker_urls: list[str]) -> Child:
        if self.service.impl is RouterImpl.sglang:   # SGLang's own router in front of the same workers
            from framework.cluster.peer_router import SglangRouter
            self.peer = SglangRouter(self.policy_cfg, self.service, worker_urls, self.cfg.cluster.startup_timeout_s,
                                     pd=self.pd_workers())
            self.metrics_url = self.peer.metrics_url
            return Child(f"sglang-router ({self.router_url})", self.router_url, self.peer.popen, -1, ready=True)
        self.peer, self.metrics_url = None, self.router_url + "/metrics"
        spec = RouterSpec(self.policy_cfg, self.service, worker_urls, self.cfg.seed)
        return spawn("router", spec, f"router {self.policy_cfg.name} ({self.router_url})", self.router_url)

    def start_router(self, router_cfg=None) -> None:
        """Start the router (again, with another policy if given) in front of the workers. External workers that are
        not up yet join when they are (the router checks them every router.health_check_interval_secs)."""
        self._arm_cleanup()
        with self.lock:
            self.stop_router()
            if router_cfg is not None:
                self.policy_cfg, self.service = _split(with_free_port(router_cfg))
            self.router_url = f"http://{_url_host(self.service.host)}:{self.service.port}"
            check_port_free(self.service.host, self.service.port, "the router", "leave router.port unset (router.port=0, "
                            "the default: a free port)")
            self.router = self.spawn_router(self.worker_urls)
            if self.peer is not None:
                return                     # SglangRouter waited until it routes to every worker
            deadline = time.monotonic() + self.cfg.cluster.startup_timeout_s
            wait_ready([self.router], deadline, self.cfg.cluster.startup_timeout_s)
            self._wait_routing(deadline)

    def _wait_routing(self, deadline: float) -> None:
        """Until the router routes to every local worker, or to one external worker at least (it checked each one's
        /health before it said it was ready)."""
        while True:
            try:
                healthy = http_json("GET", self.router_url + "/health")["healthy_workers"]
            except (OSError, ValueError, KeyError):
                healthy = -1
            if healthy == len(self.worker_urls) or (self.external and healthy > 0):
                if healthy < len(self.worker_urls):
                    log.warning("routing to %d of %d workers; the others join once they answer /health", healthy,
                                len(self.worker_urls))
                return
            if time.monotonic() > deadline:
                try:
                    listed = http_json("GET", self.router_url + "/list_workers").get("workers", [])
                    down = [f"{w['url']} ({w.get('last_health_error')})" for w in listed if not w.get("healthy")]
                except (OSError, ValueError) as e:
                    down = [f"the router itself does not answer: {e}"]
                raise ClusterError(f"after {self.cfg.cluster.startup_timeout_s:g}s the router still does not "
                                   f"route to {'any' if self.external else 'every'} worker; not healthy: {down}")
            time.sleep(0.1)

    def stop_router(self) -> None:
        with self.lock:
            if self.router is not None:
                terminate([self.router])
                self.router = None

    def stop(self) -> None:
        """Stop the supervisor, then every child (idempotent; safe from atexit and signal paths)."""
        if self.supervisor is not None:
            self.supervisor.stop()
        starting = self.supervisor.starting() if self.supervisor else []
        terminate(([self.router] if self.router else []) + self.workers + starting)
        self.router, self.workers = None, []
        atexit.unregister(self.stop)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal worker i and its ranks at once (tests and experiments/chaos: SIGKILL to die, SIGSTOP to hang,
        SIGCONT to resume)."""
        signal_group(self.workers[i].popen, sig)

    def restarts(self) -> dict[str, int]:
        """worker_restarts, router_restarts, workers_given_up so far (zeros when not supervised)."""
        counts = {"worker_restarts": 0, "router_restarts": 0, "workers_given_up": 0}
        return dict(self.supervisor.counts) if self.supervisor else counts

    # -- for the supervisor ---------------------------------------------------------------------------------------
    def poll_ready(self, child: Child) -> bool:
        """Whether ``child`` said it is ready, without waiting; ClusterError when it failed or exited first."""
        wait_ready([child], time.monotonic() + 60, self.cfg.cluster.startup_timeout_s, block=False)
        return child.ready

    @staticmethod
    def answers_health(url: str) -> bool:
        try:
            http_json("GET", url + "/health", timeout=1.0)
            return True
        except (OSError, ValueError):
            return False

    def install(self, index: int, child: Child) -> None:
        """A restarted child takes the place of the one that died."""
        if index < 0:
            self.router = child
        else:
            self.workers[index] = child

    @staticmethod
    def end_children(children: list[Child]) -> None:
        terminate(children)

    # -- what the bench reads -----------------------------------------------------------------------------------
    def flush_caches(self, timeout: float = 30.0) -> None:
        """Empty every worker's prefix cache (each must be idle), so runs start cold."""
        deadline = time.monotonic() + timeout
        for url in self.worker_urls:
            while True:
                try:
                    http_json("POST", url + "/flush_cache", data=b"{}")
                    break
                except urllib.error.HTTPError as e:
                    if e.code != 409 or time.monotonic() > deadline:
                        raise ClusterError(f"POST {url}/flush_cache failed: HTTP {e.code} {e.read()[:200]!r}")
                    time.sleep(0.1)

    def pd_workers(self) -> tuple[list[tuple[str, int]], list[str]] | None:
        """A disaggregated cluster's (prefill (url, bootstrap port) pairs, decode urls); None when every one is mixed."""
        if Role.prefill not in self.roles:
            return None
        return ([(u, self.bootstrap_ports[i]) for i, u in enumerate(self.worker_urls) if self.roles[i] is Role.prefill],
                [u for i, u in enumerate(self.worker_urls) if self.roles[i] is Role.decode])

    def warm_up(self) -> None:
        """One short request to each worker directly (the first forward pays one-time costs), then a cold cache. A
        prefill or decode worker is warmed in a pair (each with the first of the other role), as a P/D router sends."""
        body = {"text": "warm up", "sampling_params": {"max_new_tokens": 2}}
        pd = self.pd_workers()
        for i, url in enumerate(self.worker_urls):
            if pd is None or self.roles[i] is Role.mixed:
                http_json("POST", url + "/generate", timeout=60, data=json.dumps(body).encode())
                continue
            (prefill, port), decode = (pd[0][0], url) if self.roles[i] is Role.decode else \
                ((url, self.bootstrap_ports[i]), pd[1][0])
            paired = json.dumps({**body, "bootstrap_host": _url_host(self.service.host), "bootstrap_port": port,
                                 "bootstrap_room": random.getrandbits(63)}).encode()
            with ThreadPoolExecutor(2) as pool:          # both halves at once, as a P/D router sends them
                for done in [pool.submit(http_json, "POST", u + "/generate", 60, paired) for u in (prefill, decode)]:
                    done.result()
        self.flush_caches()

    def worker_infos(self) -> dict[str, dict]:
        infos = {}
        for url in self.worker_urls:
            try:
                infos[url] = http_json("GET", url + "/get_server_info")
            except (OSError, ValueError) as e:
                infos[url] = {"error": f"{type(e).__name__}: {e}"}
        return infos

    def router_stats(self, reset: bool = False) -> dict:
        if self.peer is not None:
            return self.peer.stats(reset)
        if reset:
            return http_json("POST", self.router_url + "/router_stats/reset", data=b"{}")
        return http_json("GET", self.router_url + "/router_stats")

    # -- internals ----------------------------------------------------------------------------------------------
    def _arm_cleanup(self) -> None:
        atexit.register(self.stop)
        if self._old_sigterm is None and threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, raise_system_exit)

    def _wait_health(self, urls: list[str], deadline: float) -> None:
        for url in urls:
            while True:
                try:
                    http_json("GET", url + "/health", timeout=2.0)
                    break
                except (OSError, ValueError) as e:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"worker {url} did not answer GET /health within cluster."
                                           f"startup_timeout_s={self.cfg.cluster.startup_timeout_s:g}s "
                                           f"(last error: {e})") from None
                time.sleep(0.1)
