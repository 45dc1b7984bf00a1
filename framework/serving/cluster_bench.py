"""What a bench run through a `Cluster` measures, beyond `framework.metrics.summarize`: per-worker counts from what
each worker reported (the records' meta_info, so the cache hit rate is the engines', not the router's guess), the load
imbalance, the router's decision time, retries and estimated hit rate, and the engines' KV figures."""
from __future__ import annotations

from framework.metrics import RequestRecord, summarize
from framework.moe_stats import load_stats
from framework.workload.http_client import LoadClient


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
    results.update(engine_figures(before, after))
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
    return {
        "workers": len(worker_urls),
        "load_imbalance": max(counts) / mean if mean else float("nan"),     # max / mean requests per worker
        "router_decision_p50_us": decision_us.get("p50", float("nan")),
        "router_decision_p99_us": decision_us.get("p99", float("nan")),
        "router_retries": router.get("retries", 0),
        "router_estimated_hit_rate": router.get("estimated_hit_rate", float("nan")),   # beside cache_hit_rate
        "router_reasons": router.get("reasons", {}),
        "per_worker": per_worker,
    }


def engine_figures(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """KV figures of the workers' engines (one rank's, as the in-process bench reports them), retractions during the
    run, and the largest batch any instance has run since it started."""
    infos = [i for i in after.values() if "error" not in i]
    first = infos[0] if infos else {}
    return {**_expert_load(before, after),
        "kv_bytes_per_token_per_rank": first.get("kv_bytes_per_token_per_rank", first.get("kv_bytes_per_token", 0)),
        "kv_capacity_tokens_per_rank": first.get("kv_capacity_tokens_per_rank", first.get("kv_capacity_tokens", 0)),
        "max_running_requests": max((i.get("max_running_requests", 0) for i in infos), default=0),
        "retractions": sum(_since(before.get(u, {}).get("retractions", 0), after[u].get("retractions", 0))
                           for u in after if "error" not in after[u]),
    }


def _expert_load(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Expert load of the whole cluster during the run: routed slots per expert, summed over the workers that
    report them (single-rank engines), differenced against the start."""
    if not after or not all("expert_counts" in i for i in after.values()):
        return {}
    per_layer: dict[int, list[int]] = {}
    for url, info in after.items():
        start = before.get(url, {}).get("expert_counts", {})
        for layer, counts in info["expert_counts"].items():
            delta = [_since(s, c) for c, s in zip(counts, start.get(layer, [0] * len(counts)))]
            total = per_layer.setdefault(int(layer), [0] * len(delta))
            per_layer[int(layer)] = [a + b for a, b in zip(total, delta)]
    return load_stats(per_layer, 1)


def _since(start: int, now: int) -> int:
    """A counter's growth during the run; a worker restarted meanwhile (its counter went down) counts from its start."""
    return now - start if now >= start else now
