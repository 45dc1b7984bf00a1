"""servelab's router in front of one servelab prefill worker and one decode worker on loopback, started by the
cluster (cluster.roles=[prefill,decode], router.impl=servelab): it learns the roles from each worker's /server_info,
sends a request to the pair with SGLang's bootstrap fields and answers with the decode worker's response, which
carries the tokens of one mixed instance (streamed or not). With llm-d's decode-first decider and a decode worker
that prefills locally (engine.disaggregation_local_prefill=true), a short prompt is served by the decode worker alone
(no KV moved), a long one by the pair."""
from __future__ import annotations

import http.client
import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_helpers_pd import mixed_text  # noqa: E402
from cluster_helpers import compose  # noqa: E402

from framework.cluster.cluster import Cluster  # noqa: E402

pytestmark = pytest.mark.long
LONG = ["prefill here, decode there: a prompt longer than the threshold", "the same prefix, another ending " * 3]
SHORT = "hi there"


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def streamed_text(router_url: str, prompt: str, n: int) -> str:
    conn = http.client.HTTPConnection(router_url.split("//")[1], timeout=60)
    conn.request("POST", "/generate", json.dumps({"text": prompt, "stream": True, "sampling_params":
                                                  {"max_new_tokens": n, "ignore_eos": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [json.loads(line[5:]) for line in resp.read().split(b"\n")
              if line.startswith(b"data:") and not line.startswith(b"data: [DONE]")]
    conn.close()
    return events[-1]["text"]


@pytest.mark.parametrize("policy", ["cache_aware", "precise_prefix"])   # the second follows both roles' KV events
def test_servelab_router_pairs_prefill_and_decode_and_decode_first_prefills_short_prompts_locally(policy):
    cfg = compose("cluster.instances=2", "cluster.roles=[prefill,decode]", "router.port=0", "engine.kv_budget_mb=1",
                  "engine.device=cpu", f"router={policy}", "router.impl=servelab", "cluster.restart_workers=false",
                  "router.max_retries=1", "engine.disaggregation_timeout_s=5", "router.pd_decider=decode_first",
                  f"router.pd_local_prefill_max_tokens={len(SHORT) + 8}", "engine.disaggregation_local_prefill=true")
    with Cluster(cfg) as cluster:
        cluster.warm_up()
        for prompt in LONG:
            got = post(cluster.router_url + "/generate", {"text": prompt, "sampling_params":
                                                          {"max_new_tokens": 8, "ignore_eos": True}})
            assert got["text"] == mixed_text(cfg, prompt, 8) and got["meta_info"]["completion_tokens"] == 8
            assert got["meta_info"]["kv_transfer_bytes"] > 0            # paired: the KV came from the prefill
        assert streamed_text(cluster.router_url, LONG[0] + "!", 6) == mixed_text(cfg, LONG[0] + "!", 6)  # local
        chat = post(cluster.router_url + "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": LONG[1]}], "max_tokens": 4})
        assert chat["usage"]["completion_tokens"] == 4
        local = post(cluster.router_url + "/generate", {"text": SHORT, "sampling_params":
                                                        {"max_new_tokens": 8, "ignore_eos": True}})
        assert local["text"] == mixed_text(cfg, SHORT, 8)
        assert "kv_transfer_bytes" not in local["meta_info"]             # served whole by the decode worker
        per_worker = {w["url"]: w["requests"] for w in cluster.router_stats()["workers"]}
        prefill, decode = cluster.worker_urls
        # paired: the long prompts and the chat; the stream repeats LONG[0], which the decode worker holds, and the
        # short prompt: both prefilled on the decode worker
        assert per_worker == {prefill: len(LONG) + 1, decode: len(LONG) + 3}
        if policy == "precise_prefix":   # the router's exact view: both workers' KV events reached it
            subscribed = cluster.router_stats()["kv_events"]
            assert sorted(subscribed) == sorted(cluster.worker_urls)
            assert all(sub["last_seq"] > 0 for sub in subscribed.values()), subscribed
