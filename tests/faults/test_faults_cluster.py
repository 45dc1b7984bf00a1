"""Faults on a real cluster: 4 worker processes with real engines behind the router process, under 16 concurrent
clients (the load client, streaming). Each scenario leaves the cluster whole for the next one.

- a malformed-body fuzzer (hypothesis, 1,000 bodies): every one a 4xx naming the field, the router healthy after;
- a worker answering 503 with Retry-After (a FaultProxy in front of it): retried elsewhere at once, the worker
  parked while its Retry-After runs, no breaker failure, nothing lost;
- remove_worker whose caller hangs up mid-drain: the drain goes on, joins a second caller, and the worker can be
  added back; nothing in flight is lost;
- SIGSTOP of a worker for longer than the router's silence timeout: its requests end in 504s the client retries
  elsewhere (none generated twice by the router), it is routed around, and it serves again after SIGCONT;
- SIGKILL of a worker mid-run: no request lost, the router's load counters back to 0, the router's estimated cache
  hit rate within 0.02 of the one the workers measured, the worker restarted and serving again.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cluster_helpers import cluster_cfg, group_alive
from fault_helpers import BackgroundApp, BackgroundLoad, grouped_sessions, listed, routable, wait_for
from framework.report.metrics import summarize
from framework.cluster.cluster import Cluster, http_json
from framework.testing.faults import FaultPlan, FaultProxy
from framework.load.http_client import LoadClient

pytestmark = pytest.mark.long   # a 4-worker cluster and five scenarios: CI's second command
SILENCE_S = 2.0


@pytest.fixture(scope="module")
def cluster():
    cfg = cluster_cfg(4, "router=cache_aware", "engine.kv_budget_mb=4", "workload=shared_prefix",
                      "workload.max_concurrency=16", "router.health_check_interval_secs=0.5",
                      "router.health_check_timeout_secs=1", f"router.request_timeout_s={SILENCE_S}",
                      "router.abort_timeout_s=1", "cluster.restart_backoff_s=0.2")
    with Cluster(cfg) as c:
        c.warm_up()
        yield c, cfg
        groups = [w.popen.pid for w in c.workers] + [c.router.popen.pid]
    deadline = time.monotonic() + 20
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(group_alive(g) for g in groups)  # restarted children included: no orphans


def play(c, cfg, sessions, retries=2) -> tuple[LoadClient, BackgroundLoad]:
    client = LoadClient(c.router_url, cfg.workload, retries=retries, request_timeout_s=90)
    return client, BackgroundLoad(client, sessions)


def assert_no_load(router_url: str) -> None:
    state = listed(router_url)
    assert all(n == 0 for n in state["loads"].values()), state["loads"]
    assert all(w["in_flight"] == 0 for w in state["workers"]), state["workers"]


# -- 1,000 malformed bodies --------------------------------------------------------------------------------------------
junk = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=5),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
not_texts = junk.filter(lambda v: not isinstance(v, str)) | st.just([]) | st.lists(junk.filter(
    lambda v: not isinstance(v, str)), min_size=1, max_size=3)
not_token_ids = st.just([]) | st.lists(st.integers(max_value=-1), min_size=1, max_size=3) | st.lists(
    st.one_of(st.floats(), st.booleans()), min_size=1, max_size=3) | st.just([[]])
bad_message = st.one_of(junk, st.fixed_dictionaries({"role": st.text(max_size=8).filter(
    lambda r: r not in ("system", "developer", "user", "assistant", "tool", "function"))}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        st.integers(), st.lists(junk, min_size=1, max_size=2))}))
malformed = st.one_of(
    st.tuples(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]), st.one_of(
        st.binary(max_size=40).map(lambda b: b"{" + b),                         # not JSON
        st.one_of(junk, st.lists(junk, max_size=3)).filter(lambda v: not isinstance(v, dict)).map(json.dumps))),
    st.tuples(st.just("/generate"), st.one_of(
        st.fixed_dictionaries({"text": not_texts}), st.fixed_dictionaries({"input_ids": not_token_ids}),
        st.fixed_dictionaries({"sampling_params": junk})).map(json.dumps)),
    st.tuples(st.just("/v1/completions"), st.one_of(
        st.fixed_dictionaries({"prompt": not_texts.filter(lambda v: v != [] and not isinstance(v, list))}),
        st.fixed_dictionaries({"prompt": not_token_ids}), st.fixed_dictionaries({"max_tokens": junk})).map(json.dumps)),
    st.tuples(st.just("/v1/chat/completions"), st.one_of(
        st.fixed_dictionaries({"messages": junk}).filter(lambda b: not isinstance(b["messages"], list)),
        st.fixed_dictionaries({"messages": st.lists(bad_message, min_size=1, max_size=3)})).map(json.dumps)),
)


def test_a_thousand_malformed_bodies_each_get_a_4xx_naming_the_field(cluster):
    c, _ = cluster
    host, port = c.router_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    sent_before = sum(w["requests"] for w in listed(c.router_url)["workers"])
    answers = []

    @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(malformed)
    def post(case):
        path, body = case
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        answers.append(resp.status)
        assert 400 <= resp.status < 500 and error["message"], (path, body, resp.status, error)
        assert error["param"] is None or error["message"].startswith(error["param"].split(".")[0]), error

    post()
    conn.close()
    assert len(answers) == 1000 and all(400 <= s < 500 for s in answers)
    health = http_json("GET", c.router_url + "/health")
    assert health == {"status": "ok", "workers": 4, "healthy_workers": 4}
    assert sum(w["requests"] for w in listed(c.router_url)["workers"]) == sent_before  # none reached a worker


# -- 503 with Retry-After ----------------------------------------------------------------------------------------------
def test_a_worker_answering_503_with_retry_after(cluster):
    c, cfg = cluster
    real = c.worker_urls[3]
    proxy = FaultProxy(real, FaultPlan(error_rate=1.0, error_status=503, retry_after_s=1.0))
    front = BackgroundApp(proxy.app())
    try:
        http_json("POST", f"{c.router_url}/remove_worker?url={real}", data=b"")
        http_json("POST", f"{c.router_url}/add_worker?url={front.url}", data=b"")
        retries0 = c.router_stats()["retries"]
        client, load = play(c, cfg, grouped_sessions(16, 4, seed=1))
        records, _ = load.result()
        assert len(records) == 64 and all(r.ok for r in records), [r.error for r in records if not r.ok]
        busy = next(w for w in listed(c.router_url)["workers"] if w["url"] == front.url)
        answered_503 = proxy.counts["error_503"]
        assert answered_503 >= 1 and busy["breaker"] == "closed" and busy["failures"] == 0
        # honoured: once a 503 is out, nothing new reaches the worker for its Retry-After (what the router had
        # already sent may still arrive within a moment)
        arrivals = [t for t, what in proxy.events if what == "request"]
        for t503 in (t for t, what in proxy.events if what == "error_503"):
            assert not [t for t in arrivals if t503 + 0.1 < t < t503 + 0.9], (t503, arrivals)
        assert c.router_stats()["retries"] - retries0 == answered_503  # each retried at once, on another worker
        assert client.retries == 0 and {r.worker for r in records} <= set(c.worker_urls[:3])
        proxy.set_plan(FaultPlan())  # it recovers: it serves again once its Retry-After has passed
        wait_for(lambda: routable(c.router_url, front.url) and
                 next(w for w in listed(c.router_url)["workers"] if w["url"] == front.url)["retry_after_s"] == 0,
                 5, "the Retry-After to pass")
        _, load = play(c, cfg, grouped_sessions(8, 1, seed=2))
        assert any(r.worker == front.url for r in load.result()[0])
        assert_no_load(c.router_url)
    finally:
        http_json("POST", f"{c.router_url}/remove_worker?url={front.url}", data=b"")
        http_json("POST", f"{c.router_url}/add_worker?url={real}", data=b"")
        front.close()


# -- remove_worker whose caller leaves -----------------------------------------------------------------------------
def test_remove_worker_survives_a_caller_that_disconnects(cluster):
    c, cfg = cluster
    http_json("POST", c.router_url + "/flush_cache", data=b"")  # empty trees: the new prefixes spread over all
    client, load = play(c, cfg, grouped_sessions(8, 2, seed=3, output_len=128))
    victim = c.worker_urls[2]
    wait_for(lambda: next(w for w in listed(c.router_url)["workers"] if w["url"] == victim)["in_flight"] > 0, 30,
             "requests on the worker to remove")
    with pytest.raises(OSError):  # the caller gives up after 50 ms and hangs up
        http_json("POST", f"{c.router_url}/remove_worker?url={victim}", timeout=0.05, data=b"")
    state = next(w for w in listed(c.router_url)["workers"] if w["url"] == victim)
    assert state["draining"] and state["in_flight"] > 0  # still draining: no new requests, the old ones finish
    second = {}
    joiner = threading.Thread(target=lambda: second.update(
        answer=http_json("POST", f"{c.router_url}/remove_worker?url={victim}", timeout=60, data=b"")))
    joiner.start()
    records, _ = load.result()
    joiner.join(60)
    assert second["answer"]["removed"] == victim and second["answer"]["abandoned_requests"] == 0
    assert victim not in listed(c.router_url)["urls"]
    assert len(records) == 16 and all(r.ok for r in records) and client.retries == 0  # none lost or retried
    added = http_json("POST", f"{c.router_url}/add_worker?url={victim}", data=b"")
    assert added["healthy"] and listed(c.router_url)["loads"][victim] == 0
    assert_no_load(c.router_url)


# -- SIGSTOP past the silence timeout ----------------------------------------------------------------------------
def test_a_stopped_worker_is_routed_around_and_serves_again(cluster):
    c, cfg = cluster
    victim = c.worker_urls[1]
    restarts0 = c.restarts()["worker_restarts"]
    client, load = play(c, cfg, grouped_sessions(16, 6, seed=4, output_len=16))
    load.wait_for(16)
    c.kill_worker(1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: not routable(c.router_url, victim), 10, "the health check to drop the stopped worker")
    time.sleep(max(0.0, 2 * SILENCE_S - (time.monotonic() - stopped_at)))
    c.kill_worker(1, signal.SIGCONT)
    records, _ = load.result()
    assert len(records) == 96 and all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert client.retries >= 1  # what it held was given back as 504s (it could not confirm an abort)
    assert c.restarts()["worker_restarts"] == restarts0  # stopped, not dead: nothing to restart
    wait_for(lambda: routable(c.router_url, victim), 10, "the resumed worker to pass a health check")
    wait_for(lambda: http_json("GET", victim + "/get_server_info")["http_in_flight"] == 0, 10,
             "the resumed worker to drop the requests the router gave up on")
    _, load = play(c, cfg, grouped_sessions(8, 1, seed=5))
    assert any(r.worker == victim for r in load.result()[0])
    assert_no_load(c.router_url)


# -- SIGKILL mid-run -------------------------------------------------------------------------------------------
def test_a_killed_worker_loses_nothing_and_comes_back(cluster):
    c, cfg = cluster
    victim, old_pid = c.worker_urls[1], c.workers[1].popen.pid
    restarts0 = c.restarts()["worker_restarts"]
    http_json("POST", c.router_url + "/flush_cache", data=b"")  # cold caches, and the router's estimate of them
    c.router_stats(reset=True)
    client, load = play(c, cfg, grouped_sessions(16, 6, seed=6))
    load.wait_for(24)
    c.kill_worker(1)
    killed_at = time.monotonic()
    records, duration = load.result()
    router = c.router_stats()
    assert len(records) == 96 and all(r.ok for r in records), [r.error for r in records if not r.ok]
    measured = summarize(records, duration)["cache_hit_rate"]
    assert abs(router["estimated_hit_rate"] - measured) <= 0.02, (router["estimated_hit_rate"], measured)
    assert_no_load(c.router_url)
    wait_for(lambda: routable(c.router_url, victim), 60, "the killed worker to be restarted and added back")
    assert time.monotonic() - killed_at < 60 and c.restarts()["worker_restarts"] == restarts0 + 1
    assert c.workers[1].popen.pid != old_pid and not group_alive(old_pid)
    _, load = play(c, cfg, grouped_sessions(8, 1, seed=7))
    served = load.result()[0]
    assert all(r.ok for r in served) and any(r.worker == victim for r in served)  # new prefixes: its tree is empty
    assert_no_load(c.router_url)
