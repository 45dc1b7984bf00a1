"""Client-only mode (mode=bench with cluster.url): `python run.py cluster.url=http://host:port` drives a server started elsewhere (an SGLang or
vLLM server, servelab's or SGLang's router, any OpenAI-compatible endpoint) with the workload, starting nothing, and
reports the same client-side figures. Worker-side figures come only where the server gives them: per-worker counts
when a servelab router names the answering worker, its /router_stats, and per-worker load over time from its
/metrics."""
from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request

from framework.cluster.figures import cluster_figures
from framework.core.errors import UserError
from framework.load.http_client import LoadClient
from framework.report.metrics import summarize
from framework.runs.checks import build_sessions
from framework.runs.finish import finish
from framework.runs.progress import phase


def _reachable(url: str) -> str | None:
    """None when something accepts connections at the URL's host and port, else why not."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), 5):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def _router_stats(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/router_stats", timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return {}


def run(cfg, out_dir: str, resolved: dict) -> float:
    """mode=bench against cluster.url: play the workload, report, return output tok/s."""
    url = cfg.cluster.url.rstrip("/")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https") or not urllib.parse.urlsplit(url).hostname:
        raise UserError(f"cluster.url={cfg.cluster.url!r} is not an http:// or https:// URL with a host")
    if (why := _reachable(url)) is not None:
        raise UserError(f"cluster.url={url}: nothing accepts connections there ({why}); start the server first")
    sessions = build_sessions(cfg)
    try:
        client = LoadClient(url, cfg.workload, request_timeout_s=cfg.cluster.request_timeout_s,
                            retries=cfg.cluster.client_retries, progress=sys.stderr.isatty())
    except ValueError as e:
        raise UserError(str(e)) from None
    _router_stats_reset(url)
    total = sum(len(s.turns) for s in sessions)
    phase(f"playing {total} requests against {url}", done=lambda: f"{len(client.records)} of {total} done")
    records, duration = client.play(sessions)
    results = {"target_url": url, "api": client.api.value, **summarize(records, duration, cfg.workload.slo),
               "client_retries": client.retries}
    workers = sorted({r.worker for r in records if r.worker and r.worker != url})
    if workers:                       # a servelab router named the worker of each answer
        results.update(cluster_figures(records, workers, _router_stats(url), {}))
    if client.load_timeline:
        results["worker_load_timeline"] = client.load_timeline
    return finish(cfg, out_dir, resolved, f"client bench: {cfg.workload.name} -> {url} (api={client.api.value})",
                  results, records)


def _router_stats_reset(url: str) -> None:
    """A servelab router's stats window starts with this run (other servers answer 404: nothing to reset)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/router_stats/reset", data=b"{}", method="POST"),
                               timeout=5).close()
    except (OSError, urllib.error.HTTPError):
        pass
