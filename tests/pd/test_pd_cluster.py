"""SGLang's router in its P/D mode (sglang-router 0.3.2 `--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode
URL`) in front of one servelab prefill worker and one decode worker on loopback, started by the cluster
(cluster.roles=[prefill,decode], router.impl=sglang): the router reads both workers' /server_info and /model_info,
sends every request to both with SGLang's bootstrap fields, and answers with the decode worker's response, which
carries the tokens of one mixed instance. Faults: a client that leaves, a decode worker killed while it waits for the
KV, a prefill worker killed before it sends it: the client gets an error, never a hang, and the survivor's every
pre-allocated slot is freed (its pool counters back to their start)."""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from cluster_helpers_pd import compose_pd, mixed_text
from framework.cluster.cluster import Cluster
from framework.cluster.figures import bench
from framework.cluster.peer_router import installed_version
from framework.core.registry import WORKLOAD

pytestmark = [pytest.mark.long,
              pytest.mark.skipif(installed_version() is None, reason="sglang-router is not installed ('.[peers]')")]
PROMPTS = ["prefill here, decode there", "the same prefix, another ending " * 3]


def post(url: str, body: dict, timeout: float = 30.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def info(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())


def settled(url: str, timeout: float = 15.0) -> dict:
    """The worker once nothing is in flight and its cache is flushed: what its requests still hold."""
    deadline = time.monotonic() + timeout
    while True:
        i = info(url)
        idle = sum(i[k] for k in ("running_requests", "queued_requests", "kv_waiting_slots", "kv_receiving",
                                  "kv_sending", "kv_bootstrapping")) == 0
        if idle:
            try:
                post(url + "/flush_cache", {})
                wait_until(lambda: info(url)["cache_tokens"] == 0, 5, "the flushed cache reported")
                return info(url)
            except urllib.error.HTTPError:
                pass                                  # a request still in flight: retry
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still busy after {timeout} s: {i}")
        time.sleep(0.1)


def in_background(fn, *args):
    """Run fn(*args) in a thread; returns a function that waits for it and gives its result or exception."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:            # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lambda timeout: (t.join(timeout), out)[1]


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def stranded_request(cluster, victim: int) -> tuple[dict, str]:
    """Stop the prefill worker (SIGSTOP) so the decode worker waits for a request's KV with its slots pre-allocated,
    then kill worker `victim` (0: the prefill, 1: the decode) and resume the prefill. (what the client got, the
    survivor's URL)."""
    prefill, decode = cluster.worker_urls
    cluster.kill_worker(0, signal.SIGSTOP)
    result = in_background(post, cluster.router_url + "/generate",
                           {"text": "stranded " * 8, "sampling_params": {"max_new_tokens": 8}}, 60.0)
    wait_until(lambda: info(decode)["kv_receiving"] == 1, 10, "the decode worker pre-allocated the slots")
    cluster.kill_worker(victim, signal.SIGKILL)
    cluster.kill_worker(0, signal.SIGCONT)
    return result(45), (prefill, decode)[1 - victim]


def http_error(out: dict) -> tuple[int, str]:
    err = out.get("error")
    assert isinstance(err, urllib.error.HTTPError), f"the client got no error: {out}"
    return err.code, err.read().decode()


def test_sglang_router_pd_mode_serves_a_mixed_instances_tokens_and_faults_free_every_slot():
    cfg = compose_pd()
    with Cluster(cfg) as cluster:
        prefill, decode = cluster.worker_urls
        assert cluster.peer.args[cluster.peer.args.index("--pd-disaggregation") + 1:][:5] == \
            ["--prefill", prefill, str(cluster.bootstrap_ports[0]), "--decode", decode]
        assert [get(u + "/server_info")["disaggregation_mode"] for u in cluster.worker_urls] == ["prefill", "decode"]
        assert get(decode + "/model_info")["is_generation"]
        with pytest.raises(urllib.error.HTTPError) as refused:        # a half without its pairing
            post(decode + "/generate", {"text": "no room"})
        assert refused.value.code == 400 and "bootstrap_host" in refused.value.read().decode()
        cluster.warm_up()                             # (mode=bench's: each worker in a pair, then cold caches)
        start = {u: settled(u)["kv_used_tokens"] for u in cluster.worker_urls}
        for prompt in PROMPTS:
            got = post(cluster.router_url + "/generate", {"text": prompt, "sampling_params":
                                                          {"max_new_tokens": 8, "ignore_eos": True}})
            assert got["text"] == mixed_text(cfg, prompt, 8) and got["meta_info"]["completion_tokens"] == 8
            assert got["meta_info"]["kv_transfer_bytes"] > 0
            chat = post(cluster.router_url + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
            assert chat["usage"]["completion_tokens"] == 4
        # a workload through the router: every request served, its KV transfer in the per-request records
        wl = compose_pd("workload=random", "workload.num_prompts=6", "workload.input_len=32",
                        "workload.output_len=4", "workload.max_concurrency=3").workload
        results, records = bench(cluster, cfg, WORKLOAD.build("random", wl, 0).sessions())
        assert results["requests_failed"] == 0 and all(r.kv_transfer_bytes > 0 for r in records)
        # a client that leaves mid-stream: both halves end, nothing stays allocated
        conn = http.client.HTTPConnection(cluster.router_url.split("//")[1], timeout=30)
        conn.request("POST", "/generate", json.dumps({"text": "a long answer", "stream": True, "sampling_params":
                                                      {"max_new_tokens": 300, "ignore_eos": True}}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data:")
        conn.close()
        assert {u: settled(u)["kv_used_tokens"] for u in cluster.worker_urls} == start
        # the prefill worker killed before it sends the KV: the decode side times out (the router retries once)
        code, body = http_error(stranded_request(cluster, victim=0)[0])
        assert code == 500 and "no KV from the prefill instance" in body
        assert settled(decode, timeout=20)["kv_used_tokens"] == start[decode]
        assert info(decode)["kv_transfer_failures"] >= 1


def test_a_decode_worker_killed_while_it_waits_fails_the_request_and_the_prefill_frees_its_slots():
    cfg = compose_pd()
    with Cluster(cfg) as cluster:
        prefill = cluster.worker_urls[0]
        start = settled(prefill)["kv_used_tokens"]
        out, survivor = stranded_request(cluster, victim=1)
        code, body = http_error(out)
        assert survivor == prefill and code == 502 and "decode_server_error" in body
        assert settled(prefill, timeout=20)["kv_used_tokens"] == start
        assert info(prefill)["kv_transfer_failures"] >= 1


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())
