"""router.impl=sglang with router.dp_aware=true: sglang-router 0.3.2 runs with --dp-aware. Seen with the real binary:
it reads each worker's dp_size from GET /server_info, registers `url@rank` per DP group, and puts the rank it chose
in the body's data_parallel_rank, in /generate and in the OpenAI bodies alike.

The long test puts it in front of a real two-rank DP-attention worker whose own DP controller is shortest_queue: one
request at a time, that controller would send every request to group 0 (both idle: the lowest rank). With --dp-aware,
sglang-router's round robin over url@0 and url@1 spreads them over both groups (the worker's requests_per_rank is
the oracle), /v1/completions included (a worker that ignored the OpenAI body's data_parallel_rank gives [4, 0])."""
from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest

from framework.cluster.cluster import Cluster
from framework.cluster.peer_router import installed_version, sglang_router_args
from framework.config import refuse_ignored_keys
from parallel_helpers import make_cfg

needs_sglang = pytest.mark.skipif(installed_version() is None, reason="sglang-router is not installed ('.[peers]')")


def test_dp_aware_is_passed_to_sglang_router_as_its_flag():
    overrides = ["router=round_robin", "router.impl=sglang", "router.dp_aware=true"]
    cfg = make_cfg(*overrides)
    refuse_ignored_keys(cfg, overrides)                     # no longer refused
    assert "--dp-aware" in sglang_router_args(cfg.router, cfg.router, ["http://127.0.0.1:1"], 4000, 4001)
    plain = dataclasses.replace(cfg.router, dp_aware=False)
    assert "--dp-aware" not in sglang_router_args(plain, plain, ["http://127.0.0.1:1"], 4000, 4001)


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.long
@needs_sglang
def test_sglang_router_dp_aware_spreads_requests_over_the_dp_groups():
    cfg = make_cfg("cluster.instances=1", "router.port=0", "engine.kv_budget_mb=1", "router=round_robin",
                   "router.impl=sglang", "parallel=dp_attn", "parallel.size=2", "parallel.dp_balance=shortest_queue",
                   "router.dp_aware=true")
    with Cluster(cfg) as c:
        for i in range(2):               # one at a time: the instance's shortest queue always sees two idle groups
            post(c.router_url, "/generate", {"text": f"request {i} of four", "sampling_params": {
                "max_new_tokens": 2, "ignore_eos": True}})
            post(c.router_url, "/v1/completions", {"model": "servelab", "prompt": f"request {i} again",
                                                   "max_tokens": 2, "ignore_eos": True})
        with urllib.request.urlopen(c.worker_urls[0] + "/get_server_info", timeout=10) as r:
            info = json.loads(r.read())
    assert info["requests_per_rank"] == [2, 2]
