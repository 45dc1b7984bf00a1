"""router.dp_aware=true on a real cluster: a router process in front of one worker process whose instance is two
DP-attention ranks (gloo), its own DP controller prefix-blind (round_robin). The router keeps a candidate per DP group
(it learns dp_size from the worker's /server_info) and names the group it chose in X-Data-Parallel-Rank, so each of
two conversations stays on a group of its own (cache_aware sends a new one to the group with the smaller tree) and
its second turn hits that group's cache. Control: without dp_aware the instance's round robin sends each second turn
to the other group, which misses."""
from __future__ import annotations

import json
import urllib.request

import pytest

from framework.cluster.cluster import Cluster
from parallel_helpers import make_cfg

pytestmark = pytest.mark.long

CONVERSATIONS = ["The expert latent cache routes every decode step of the model to one rank " * 2,
                 "Prefill chunks queue behind the scheduler while the radix tree keeps its shared prefixes " * 2]


def generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("dp_aware", [True, False])
def test_the_router_sends_a_conversation_back_to_its_dp_group(dp_aware):
    cfg = make_cfg("cluster.instances=1", "router.port=0", "engine.kv_budget_mb=1", "router=cache_aware",
                   "parallel=dp_attn", "parallel.size=2", "parallel.dp_balance=round_robin",
                   f"router.dp_aware={str(dp_aware).lower()}")
    turns = []
    with Cluster(cfg) as c:
        for text in CONVERSATIONS:       # one after the other: turn 1, then turn 2 with turn 1's answer
            first = generate(c.router_url, text)
            turns.append((first, generate(c.router_url, text + first["text"] + " and then?")))
        info = json.loads(urllib.request.urlopen(c.worker_urls[0] + "/get_server_info", timeout=10).read())
    cached = [second["meta_info"]["cached_tokens"] for _, second in turns]
    assert info["requests_per_rank"] == [2, 2]
    if dp_aware:
        assert all(c >= first["meta_info"]["prompt_tokens"] - 1 for c, (first, _) in zip(cached, turns)), cached
    else:
        assert cached == [0, 0]
