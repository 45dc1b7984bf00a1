"""SGLang's own router as a contender: `router.impl=sglang` starts sglang-router (the Rust router from the package
registry, `pip install -e '.[peers]'`, pinned at 0.3.2) in front of the same workers, with the same policy and
thresholds, where servelab would start its own router process.

Each routing policy says how sglang-router runs it (`RoutingPolicy.sglang_args`: `--policy` and its thresholds, or
the reason it cannot, which is refused with that reason); the service settings map here:

| servelab                        | sglang-router 0.3.2                                                          |
|---------------------------------|------------------------------------------------------------------------------|
| router=<policy> and its fields  | the policy's `sglang_args` (fields it has no flag for: `sglang_ignores`)      |
| router.host / router.port       | --host / --port; its Prometheus endpoint gets a free port of its own          |
| router.max_retries              | --retry-max-retries (0: --disable-retries)                                   |
| router.max_concurrent_requests  | --max-concurrent-requests (and the three below only when it is set, >= 1)    |
| router.queue_size               | --queue-size                                                                 |
| router.queue_timeout_secs       | --queue-timeout-secs (whole seconds, rounded up: SGLang takes an integer)    |
| router.rate_limit_tokens_per_second | --rate-limit-tokens-per-second (rounded up to an integer)               |
| router.api_key                  | --api-key                                                                    |
| router.control_plane_api_keys   | --control-plane-api-keys ('id:name:role:key' each)                           |
| router.control_plane_audit_enabled | --control-plane-audit-enabled (when true)                                 |
| router.tls_cert_path / _key_path | --tls-cert-path / --tls-key-path                                            |
| router.cors_allowed_origins     | --cors-allowed-origins (none: SGLang allows every origin, servelab none)     |
| router.request_id_headers       | --request-id-headers (none: both use x-request-id, x-correlation-id,         |
|                                 | x-trace-id, request-id)                                                      |
| router.dp_aware                 | --dp-aware: it reads each worker's dp_size from GET /server_info, routes to  |
|                                 | `url@rank` and puts the rank in the body's data_parallel_rank (OpenAI too)   |
| other router.* service settings | not passed: SGLang's defaults (backoff, breaker, health checks); a run that   |
|                                 | sets one is refused at start (framework/config.py, refuse_ignored_keys)       |

SGLang's router reports through Prometheus (`smg_*` series on `--prometheus-port`): per-worker attempts
(`smg_worker_cb_outcomes_total`), retries (`smg_worker_retries_total`) and requests in flight per worker
(`smg_worker_requests_active`). `stats()` reads them into the keys servelab's `/router_stats` uses, with the router
process's CPU time from /proc; it has no decision timer and no estimate of the hit rate.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from framework.contracts.routing import SGLANG_ROUTER_VERSION, NotExpressible, RoutingPolicy
from framework.core.errors import ClusterError
from framework.core.registry import ROUTING
from framework.core.ports import free_ports
from framework.core.proc import cpu_times

log = logging.getLogger("servelab.peer_router")
PINNED = SGLANG_ROUTER_VERSION
# the router.* service settings sglang-router is given (front_door_args: the front door's, under SGLang's own names)
SERVICE_FLAGS = ("impl", "host", "port", "max_retries", "max_concurrent_requests", "queue_size", "queue_timeout_secs",
                 "rate_limit_tokens_per_second", "api_key", "control_plane_api_keys", "control_plane_audit_enabled",
                 "tls_cert_path", "tls_key_path", "cors_allowed_origins", "request_id_headers", "dp_aware")
_SERIES = re.compile(r'^(smg_worker_cb_outcomes_total|smg_worker_retries_total)\{([^}]*)\}\s+(\S+)', re.M)


class PeerRouterError(ClusterError):
    """The config asks for something sglang-router cannot do, or it did not come up."""


def expressible_policies() -> list[str]:
    """The routing policies that say how sglang-router runs them (they implement `RoutingPolicy.sglang_args`)."""
    base = RoutingPolicy.sglang_args.__func__
    return [key for key in ROUTING.keys() if ROUTING.get(key).sglang_args.__func__ is not base]


def sglang_router_args(rc, service, worker_urls: list[str], port: int, prometheus_port: int, pd=None) -> list[str]:
    """sglang_router.launch_router's command-line arguments for the policy config `rc` and the service settings.
    `pd`: (prefill (url, bootstrap port) pairs, decode urls) for its P/D mode (--pd-disaggregation) instead."""
    policy = ROUTING.get(rc.name)
    try:
        policy_args = policy.sglang_args(rc)
    except NotExpressible as e:
        runs = "" if rc.name in expressible_policies() else f"; it runs {', '.join(expressible_policies())}"
        raise PeerRouterError(f"router.impl=sglang: {e}{runs}") from None
    workers = ["--worker-urls", *worker_urls] if pd is None else ["--pd-disaggregation", *[
        a for url, boot in pd[0] for a in ("--prefill", url, str(boot))], *[a for url in pd[1] for a in ("--decode", url)]]
    args = ["--host", service.host, "--port", str(port), *workers, *policy_args,
            "--prometheus-host", service.host, "--prometheus-port", str(prometheus_port), "--log-level", "error"]
    args += ["--retry-max-retries", str(service.max_retries)] if service.max_retries > 0 else ["--disable-retries"]
    if service.dp_aware:
        args.append("--dp-aware")
    for flag, name in (("--prefill-policy", getattr(service, "prefill_policy", None)),
                       ("--decode-policy", getattr(service, "decode_policy", None))):
        if pd is not None and name is not None:   # its P/D mode's policy per role (the thresholds: --policy's)
            role_args = _args_of(name)
            args += [flag, role_args[role_args.index("--policy") + 1]]
    return args + front_door_args(service)


def _args_of(name: str) -> list[str]:
    try:
        return ROUTING.get(name).sglang_args(ROUTING.get(name).Config())
    except NotExpressible as e:
        raise PeerRouterError(f"router.impl=sglang: {e}") from None


def front_door_args(service) -> list[str]:
    """Admission control and security settings as sglang-router flags (the same names; SGLang's defaults where
    servelab's are left alone)."""
    args: list[str] = []
    if service.max_concurrent_requests > 0:
        args += ["--max-concurrent-requests", str(service.max_concurrent_requests),
                 "--queue-size", str(service.queue_size),
                 "--queue-timeout-secs", str(math.ceil(service.queue_timeout_secs))]
        if service.rate_limit_tokens_per_second:
            args += ["--rate-limit-tokens-per-second", str(math.ceil(service.rate_limit_tokens_per_second))]
    if service.api_key:
        args += ["--api-key", service.api_key]
    if service.control_plane_api_keys:
        args += ["--control-plane-api-keys", *service.control_plane_api_keys]
    if service.control_plane_audit_enabled:
        args.append("--control-plane-audit-enabled")
    if service.tls_cert_path:
        args += ["--tls-cert-path", service.tls_cert_path, "--tls-key-path", service.tls_key_path]
    for flag, values in (("--cors-allowed-origins", service.cors_allowed_origins),
                         ("--request-id-headers", service.request_id_headers)):
        if values:
            args += [flag, *values]
    return args


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        return None


def _die_with_parent() -> None:   # runs in the child before exec: SIGTERM it when the parent dies (Linux)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class SglangRouter:
    """One sglang-router process in front of `worker_urls`, ready (routing to every worker) once constructed."""

    def __init__(self, rc, service, worker_urls: list[str], startup_timeout_s: float, pd=None):
        version = installed_version()
        if version is None:
            raise PeerRouterError(f"router.impl=sglang needs SGLang's router: pip install -e '.[peers]' "
                                  f"(sglang-router=={PINNED})")
        if version != PINNED:
            log.warning("sglang-router %s is installed; the config mapping was checked against %s", version, PINNED)
        if pd is not None and service.dp_aware and version == PINNED:
            raise PeerRouterError(f"router.impl=sglang with prefill/decode workers and router.dp_aware=true: "
                                  f"sglang-router {PINNED}'s P/D mode sends each half to 'url@rank' as if it were a "
                                  f"URL, so every request fails (tests/serving/test_router_dp_ranks_pd.py; fixed "
                                  f"upstream in sgl-project/sglang#26245). Use router.impl=servelab, or "
                                  f"router.dp_aware=false")
        host = "127.0.0.1" if service.host in ("", "0.0.0.0") else service.host
        prometheus_port = free_ports(service.host, 1)[0]
        self.url, self.metrics_url = f"http://{host}:{service.port}", f"http://{host}:{prometheus_port}/metrics"
        self.args = sglang_router_args(rc, service, worker_urls, service.port, prometheus_port, pd) + [
            "--worker-startup-timeout-secs", str(math.ceil(startup_timeout_s)), "--worker-startup-check-interval", "1"]
        self.workers = list(worker_urls)
        self.popen = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *self.args],
                                      start_new_session=True, preexec_fn=_die_with_parent)
        self._base: tuple[dict, float] = ({}, 0.0)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _routed(self) -> int | None:
        """How many workers /readiness counts once every one is registered: one per worker, or under --dp-aware one per
        DP group (each worker's dp_size, from its /server_info as sglang-router reads it; None: one did not answer)."""
        if "--dp-aware" not in self.args:
            return len(self.workers)
        total = 0
        for url in self.workers:
            try:
                with urllib.request.urlopen(url + "/server_info", timeout=2) as resp:
                    total += int(json.loads(resp.read()).get("dp_size") or 1)
            except (OSError, ValueError, TypeError):
                return None
        return total

    def _wait_ready(self, timeout_s: float) -> None:
        """Until /readiness says every worker is registered and healthy (it registers them in the background)."""
        deadline, last, routed = time.monotonic() + timeout_s, "no answer yet", None
        while True:
            if self.popen.poll() is not None:
                raise PeerRouterError(f"sglang-router exited with status {self.popen.returncode} at start (its "
                                      f"log is above); arguments: {' '.join(self.args)}")
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=2) as resp:
                    state = json.loads(resp.read())
                routed = routed or self._routed()
                if routed is not None and state.get("healthy_workers") == routed:
                    self.reset_stats()
                    return
                last = json.dumps(state)
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise PeerRouterError(f"sglang-router at {self.url} did not route to all {len(self.workers)} "
                                      f"workers within {timeout_s:g}s (last /readiness: {last})")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()

    # -- what the bench reads -------------------------------------------------------------------------------------
    def cpu_s(self) -> float:
        """User + system CPU seconds of the router process (all its threads), from /proc."""
        return sum(cpu_times(self.popen.pid))

    def _counters(self) -> dict:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        attempts: dict[str, float] = {}
        retries = 0.0
        for name, labels, value in _SERIES.findall(text):
            if name == "smg_worker_retries_total":
                retries += float(value)
            elif (m := re.search(r'worker="([^"]+)"', labels)):
                attempts[m.group(1)] = attempts.get(m.group(1), 0.0) + float(value)
        return {"attempts": attempts, "retries": retries}

    def reset_stats(self) -> None:
        self._base = (self._counters(), time.time())

    def stats(self, reset: bool = False) -> dict:
        """Since the last reset, under the keys of servelab's GET /router_stats where SGLang reports the same (reset:
        start a new window, as POST /router_stats/reset)."""
        if reset:
            self.reset_stats()
            return {"reset": True}
        now, (base, since) = self._counters(), self._base
        per_worker = {w: int(n - base["attempts"].get(w, 0.0)) for w, n in now["attempts"].items()}
        return {"impl": "sglang", "version": installed_version(), "args": self.args,
                "per_worker_requests": {w: n for w, n in per_worker.items() if n},
                "retries": int(now["retries"] - base["retries"]), "process_cpu_s": self.cpu_s(),
                "since_unix_s": since}
