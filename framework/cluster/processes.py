"""The processes of a local cluster, seen from the parent: start one (`python -m framework.cluster.proc`,
leading its own process group, a pickled spec on stdin), read its status pipe until it says it is ready, signal its
group, stop it (SIGTERM, then SIGKILL after a grace period).

A child writes to the console. While a run keeps a log (`children_output_to`: framework/runlog.py's run.log), its
stdout and stderr come through pipes instead: a thread per stream copies each line to the console as it was and to
the run's log prefixed by the child's name, so the run folder keeps what the workers and the router said."""
from __future__ import annotations

import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("servelab.cluster")
from framework.core.errors import ClusterError
from framework.core.paths import REPO_ROOT
STOP_GRACE_S = 10.0         # SIGTERM -> SIGKILL


@dataclass
class Child:
    """One process the cluster started: its name and URL for messages, and the status pipe it reports on."""
    name: str
    url: str
    popen: subprocess.Popen
    status_fd: int
    buf: bytes = b""
    ready: bool = False


_output_sinks: list[Callable[[str, str], None]] = []   # (child's name, a line of its output): the run's log


@contextmanager
def children_output_to(sink: Callable[[str, str], None]):
    """While the block runs, every child started (`launch`) also sends each line it prints to `sink`."""
    _output_sinks.append(sink)
    try:
        yield
    finally:
        _output_sinks.remove(sink)


def launch(cmd: list[str], name: str, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(cmd)`, its output to the console and, inside `children_output_to`, to that sink too."""
    sink = _output_sinks[-1] if _output_sinks else None
    if sink is None:
        return subprocess.Popen(cmd, **popen_kwargs)
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kwargs)
    for pipe, stream in ((popen.stdout, "__stdout__"), (popen.stderr, "__stderr__")):
        threading.Thread(target=_relay, args=(pipe, stream, name, sink), name=f"{name} {stream}", daemon=True).start()
    return popen


def _relay(pipe, stream: str, name: str, sink: Callable[[str, str], None]) -> None:
    """Each line of a child's stdout or stderr: to the same stream of this process's console, and to `sink`."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            console = getattr(sys, stream)
            if console is not None:
                console.write(line)
                console.flush()
            sink(name, line if line.endswith("\n") else line + "\n")


def spawn(role: str, spec, name: str, url: str) -> Child:
    """Start `python -m framework.cluster.proc ROLE FD` with `spec` on its stdin; it does not wait."""
    r, w = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        popen = launch([sys.executable, "-m", "framework.cluster.proc", role, str(w)], name.split(" (")[0],
                       stdin=subprocess.PIPE, pass_fds=(w,), start_new_session=True, env=env, cwd=str(REPO_ROOT))
    finally:
        os.close(w)
    child = Child(name, url, popen, r)
    try:
        popen.stdin.write(pickle.dumps((os.getpid(), spec)))
        popen.stdin.close()
    except BrokenPipeError:
        pass           # it died at once; wait_ready says so
    return child


def wait_ready(children: list[Child], deadline: float, startup_timeout_s: float, block: bool = True) -> None:
    """Until every child said it is ready on its status pipe (``block=False``: read what is there and return);
    ClusterError naming the child when one fails, exits or passes the deadline first."""
    pending = {c.status_fd: c for c in children if not c.ready and c.status_fd >= 0}
    while pending:
        wait = max(0.0, min(0.2, deadline - time.monotonic())) if block else 0.0
        readable, _, _ = select.select(list(pending), [], [], wait)
        for fd in readable:
            c = pending[fd]
            data = os.read(fd, 65536)
            c.buf += data
            while b"\n" in c.buf:
                line, c.buf = c.buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("event") == "error":
                    detail = f"{msg['message']}\n{msg.get('traceback', '')}".rstrip()
                    raise ClusterError(f"{c.name} failed to start: {detail}")
                c.ready = msg.get("event") == "ready"
            if c.ready or not data:
                del pending[fd]
                os.close(fd)
                c.status_fd = -1
        for fd, c in list(pending.items()):
            if c.popen.poll() is not None and not select.select([fd], [], [], 0)[0]:
                raise ClusterError(f"{c.name} exited with status {c.popen.returncode} before it was ready "
                                   f"(its stderr is above)")
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending.values())
            raise ClusterError(f"{names} did not come up within cluster.startup_timeout_s="
                               f"{startup_timeout_s:g}s")
        if not block:
            return
    for c in children:
        if not c.ready:
            raise ClusterError(f"{c.name} closed its status pipe without saying it was ready "
                               f"(exit status {c.popen.poll()})")


def raise_system_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)         # unwinds `with Cluster(...)`, which stops every child


def check_port_free(host: str, port: int, what: str, hint: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as the servers bind: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            raise ClusterError(f"port {port} on {host} for {what} is not available ({e.strerror}); stop whatever "
                               f"holds it, or {hint}") from None


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)          # the child leads its own group (start_new_session); ranks are in it
    except (ProcessLookupError, PermissionError):
        pass


def terminate(children: list[Child]) -> None:
    for c in children:
        signal_group(c.popen, signal.SIGTERM)
        signal_group(c.popen, signal.SIGCONT)    # a stopped process (SIGSTOP) acts on SIGTERM only once resumed
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs of SIGTERM: killing it", c.name, STOP_GRACE_S)
            signal_group(c.popen, signal.SIGKILL)
            c.popen.wait()
        signal_group(c.popen, signal.SIGKILL)    # anything of its group still there (a stuck rank)
        if c.status_fd >= 0:
            try:
                os.close(c.status_fd)
            except OSError:
                pass
            c.status_fd = -1


def http_json(method: str, url: str, timeout: float = 5.0, data: bytes | None = None) -> dict:
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")
