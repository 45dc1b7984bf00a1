"""router.impl=sglang: the mapping of servelab's router config onto sglang-router's flags (refusals included), and
SGLang's real router in front of 2 real servelab workers (skipped when sglang-router is not installed)."""
from __future__ import annotations

import urllib.request

import pytest

from cluster_helpers import compose
from framework.core.registry import WORKLOAD
from framework.cluster.cluster import Cluster, ClusterError
from framework.cluster.figures import bench
from framework.cluster.peer_router import PeerRouterError, installed_version, sglang_router_args

WORKERS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
needs_sglang = pytest.mark.skipif(installed_version() is None, reason="sglang-router is not installed ('.[peers]')")


def flags(args: list[str]) -> dict[str, str]:
    """--flag value pairs (the worker URLs, a list, are checked apart)."""
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}


def test_cache_aware_maps_its_thresholds():
    rc = compose("router=cache_aware_v2", "router.impl=sglang", "router.cache_threshold=0.4",
                 "router.balance_abs_threshold=7", "router.max_retries=0").router
    args = sglang_router_args(rc, rc, WORKERS, 4000, 4001)
    f = flags(args)
    assert f["--policy"] == "cache_aware" and f["--port"] == "4000" and f["--prometheus-port"] == "4001"
    assert (f["--cache-threshold"], f["--balance-abs-threshold"], f["--balance-rel-threshold"]) == ("0.4", "7", "1.5")
    assert (f["--eviction-interval-secs"], f["--max-tree-size"]) == ("120", str(2 ** 26))
    assert args[args.index("--worker-urls") + 1:args.index("--policy")] == WORKERS
    assert "--disable-retries" in args


@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_stateless_policies_map_by_name(policy):
    args = sglang_router_args(rc := compose(f"router={policy}").router, rc, WORKERS, 4000, 4001)
    assert flags(args)["--policy"] == policy and "--cache-threshold" not in args
    assert flags(args)["--retry-max-retries"] == "3"


@pytest.mark.parametrize("overrides, message", [
    (["router=cache_aware"], "smallest tree"),                                   # v0.4's miss: not in 0.3.2
    (["router=cache_aware_v2", "router.eviction_interval_secs=1.5"], "whole seconds"),
])
def test_what_sglang_router_cannot_express_is_refused(overrides, message):
    with pytest.raises(PeerRouterError, match=message):
        sglang_router_args(rc := compose(*overrides).router, rc, WORKERS, 4000, 4001)
    assert issubclass(PeerRouterError, ClusterError)          # run.py turns it into one sentence, exit status 2


def worker_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("servelab_worker_requests_total"))


@pytest.mark.long
@needs_sglang
def test_sglang_router_fronts_real_workers():
    """Round-robin through SGLang's router: every request completes, the workers' own counters (the oracle) split
    them evenly and match what the router's Prometheus series say; then cache-aware keeps a shared prefix cached."""
    cfg = compose("cluster.instances=2", "router.port=0", "engine.kv_budget_mb=1", "router=round_robin",
                  "router.impl=sglang", "workload=shared_prefix", "workload.num_groups=2",
                  "workload.prompts_per_group=4", "workload.system_prompt_len=96", "workload.question_len=8",
                  "workload.output_len=3", "workload.max_concurrency=1")
    with Cluster(cfg) as cluster:
        assert cluster.peer is not None and cluster.router_url.endswith(f":{cfg.router.port}")
        before = [worker_requests(u) for u in cluster.worker_urls]
        sessions = WORKLOAD.build("shared_prefix", cfg.workload, 0).sessions()
        results, records = bench(cluster, cfg, sessions)
        served = [worker_requests(u) - b for u, b in zip(cluster.worker_urls, before)]
        assert results["requests_completed"] == 8 and results["requests_failed"] == 0
        assert served == [4, 4] and results["load_imbalance"] == 1.0
        assert [results["per_worker"][u]["router_attempts"] for u in cluster.worker_urls] == served
        assert cluster.peer.cpu_s() > 0
        cluster.start_router(compose("router=cache_aware_v2", "router.impl=sglang", "router.port=0").router)
        cluster.flush_caches()
        results, _ = bench(cluster, cfg, sessions)
        assert results["requests_failed"] == 0 and results["cache_hit_rate"] > 0.5   # each group's prefix reused
        # why the mapping refuses v0.4's smallest-tree miss: unrelated prompts, one at a time, all go to one idle
        # worker (least loaded, ties to the first), where a smallest-tree miss would alternate between the two
        unrelated = compose("workload=random", "workload.num_prompts=6", "workload.input_len=64",
                            "workload.output_len=2", "workload.max_concurrency=1").workload
        before = [worker_requests(u) for u in cluster.worker_urls]
        bench(cluster, cfg, WORKLOAD.build("random", unrelated, 0).sessions())
        # (at most one strays: under load the router may take the next request before it has counted the last
        # one's end, and sends it to the other worker; a smallest-tree miss would give 3 and 3)
        assert max(worker_requests(u) - b for u, b in zip(cluster.worker_urls, before)) >= 5
