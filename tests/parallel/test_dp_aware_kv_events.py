"""KV events from a multi-rank worker to the router: a router process (router=precise_prefix, the exact view from KV
events) in front of one worker process whose instance is two DP-attention ranks (gloo). The worker publishes both DP
groups' events on its one stream, each batch stamped with its data_parallel_rank; with router.dp_aware=true the
router files them under the candidates url@0 and url@1.

Two conversations, each turn after the last one's events reached the router. With dp_aware: A's first turn goes to
group 0 (every view empty: the first candidate), its second turn hits there; B's first turn is a miss that goes to the
group holding the fewest blocks (miss_policy=smallest_cache), group 1, which only group 0's events can tell; B's
second turn hits group 1's blocks, which only group 1's events show (a cache hit by the router's own reasons). The
control without dp_aware leaves the group to the instance's round robin, which sends each second turn to the other
group: both miss."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from framework.cluster.cluster import Cluster
from parallel_helpers import make_cfg

pytestmark = pytest.mark.long

CONVERSATIONS = ["The expert latent cache routes every decode step of the model to one rank " * 2,
                 "Prefill chunks queue behind the scheduler while the radix tree keeps its shared prefixes " * 2]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def events_delivered(c: Cluster, timeout_s: float = 10.0) -> int:
    """Wait until the router has applied every batch the worker published; returns the worker's last sequence."""
    worker, deadline = c.worker_urls[0], time.monotonic() + timeout_s
    while True:
        published = get(worker + "/get_server_info")["kv_events"]["last_seq"]
        seen = get(c.router_url + "/router_stats")["kv_events"].get(worker, {}).get("last_seq")
        if published >= 0 and seen == published:
            return published
        assert time.monotonic() < deadline, f"the router saw batch {seen}, the worker published up to {published}"
        time.sleep(0.02)


@pytest.mark.parametrize("dp_aware", [True, False])
def test_a_dp_aware_router_follows_each_dp_groups_kv_events(dp_aware):
    cfg = make_cfg("cluster.instances=1", "router.port=0", "engine.kv_budget_mb=1", "router=precise_prefix",
                   "router.miss_policy=smallest_cache", "parallel=dp_attn", "parallel.size=2",
                   "parallel.dp_balance=round_robin", f"router.dp_aware={str(dp_aware).lower()}")
    turns = []
    with Cluster(cfg) as c:
        for text in CONVERSATIONS:       # one turn after the other, each once the router saw the last one's events
            first = generate(c.router_url, text)
            events_delivered(c)
            turns.append((first, generate(c.router_url, text + first["text"] + " and then?")))
            events_delivered(c)
        info = get(c.worker_urls[0] + "/get_server_info")
        reasons = get(c.router_url + "/router_stats")["reasons"]
    cached = [second["meta_info"]["cached_tokens"] for _, second in turns]
    assert info["requests_per_rank"] == [2, 2]
    if dp_aware:
        assert all(n >= first["meta_info"]["prompt_tokens"] - 1 for n, (first, _) in zip(cached, turns)), cached
        assert reasons.get("cache_hit") == 2, reasons     # both second turns found by the view, group 1's included
    else:
        assert cached == [0, 0]
