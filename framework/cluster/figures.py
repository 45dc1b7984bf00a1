"""What a bench run through a `Cluster` measures, beyond `framework.report.metrics.summarize`: per-worker counts from what
each worker reported (the records' meta_info, so the cache hit rate is the engines', not the router's guess), the load
imbalance, the router's decision time, retries and estimated hit rate, and the engines' figures (the same keys as an
in-process run: framework.engine.stats)."""
from __future__ import annotations

from framework.engine.stats import engine_figures
from framework.core.records import RequestRecord
from framework.report.metrics import summarize
from framework.load.http_client import LoadClient


def bench(cluster, cfg, sessions, progress: bool = False) -> tuple[dict, list[RequestRecord]]:
    """Play `sessions` through the cluster's router; returns (results, records). Router and engine counters cover
    this run only (the router's are reset, the engines' are differenced)."""
    cluster.router_stats(reset=True)
    before = cluster.worker_infos()
    client = LoadClient(cluster.router_url, cfg.workload, request_timeout_s=cfg.cluster.request_timeout_s,
                        retries=cfg.cluster.client_retries, progress=progress, metrics_url=cluster.metrics_url)
    records, duration = client.play(sessions)
    results = summarize(records, duration, cfg.workload.slo)
    after = cluster.worker_infos()
    results.update(cluster_figures(records, cluster.worker_urls, cluster.router_stats(), after))
    results.update(engine_figures([_start(before.get(u, {}), a) for u, a in after.items()], list(after.values())))
    results["client_retries"] = client.retries
    results["worker_load_timeline"] = client.load_timeline
    return results, records


def cluster_figures(records: list[RequestRecord], worker_urls: list[str], router: dict,
                    infos: dict[str, dict]) -> dict:
    per_worker = {u: {"requests": 0, "failed": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
                  for u in worker_urls}
    for r in records:
        w = per_worker.get(r.worker)
        if w is None:
            continue                     # never reached a worker (not sent, or the router answered itself)
        if not r.ok:
            w["failed"] += 1
            continue
        w["requests"] += 1
        w["prompt_tokens"] += r.prompt_tokens
        w["cached_tokens"] += r.cached_tokens
        w["completion_tokens"] += r.completion_tokens
    for u, w in per_worker.items():
        w["cache_hit_rate"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
        w["router_attempts"] = router.get("per_worker_requests", {}).get(u, 0)   # retried attempts included
        info = infos.get(u, {})
        w.update({k: info[k] for k in ("cache_tokens", "error") if k in info})
    # a router that does not name the answering worker (SGLang's): count the attempts it reports per worker
    attributed = any(r.worker in per_worker for r in records)
    counts = [w["requests" if attributed else "router_attempts"] for w in per_worker.values()]
    mean = sum(counts) / len(counts) if counts else 0.0
    decision_us = router.get("router_decision_us", {})
    accuracy = router.get("policy_accuracy") or {}  # an exact view's account: its estimate without in-flight credits
    return {
        "workers": len(worker_urls),
        "load_imbalance": max(counts) / mean if mean else float("nan"),     # max / mean requests per worker
        "router_decision_p50_us": decision_us.get("p50", float("nan")),
        "router_decision_p99_us": decision_us.get("p99", float("nan")),
        "router_retries": router.get("retries", 0),
        "router_estimated_hit_rate": router.get("estimated_hit_rate", float("nan")),   # beside cache_hit_rate
        "router_confirmed_hit_rate": (accuracy["confirmed_tokens"] / accuracy["prompt_tokens"]
                                      if accuracy.get("prompt_tokens") else float("nan")),
        "router_reasons": router.get("reasons", {}),
        "per_worker": per_worker,
    }


def _start(before: dict, after: dict) -> dict:
    """What a worker's counters are differenced against: its stats at the start of the run, or nothing when it was
    restarted meanwhile (its step counter went down: it counts from its own start)."""
    return before if after.get("steps", 0) >= before.get("steps", 0) else {}
