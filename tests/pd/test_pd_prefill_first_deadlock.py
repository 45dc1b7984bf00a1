"""Crossed orders on the real path: one prefill and one decode worker get a request's halves straight (no router) in
different orders (two routers, a network that reorders, or the prefill's lpm policy putting a cached prefix first
would do it): the decode side sees A, B, C (its pool pre-allocates one request at a time: A gets its slots, B and C
wait), the prefill side B, C, A (its pool holds two prompts' KV, not three).

- SGLang's order (`engine.disaggregation_order=sglang`, the default): a prefill request waits for its room's
  destination before it is prefilled, holding no KV. B and C wait so, A's destination is already there, A goes
  through, its slots come back for B, then C: every request completes, nothing fails, both pools end where they
  started.
- DistServe's order (`distserve`: prefill at once, hold the KV until the destination comes) deadlocks: the decode
  pool is full of A's slots, A cannot get into the prefill pool full of B's and C's KV, which wait for slots. Only
  `engine.disaggregation_timeout_s` breaks it: the decode side's ask for A's KV runs out first (it cancels A's
  room); KV held for B or C that nobody asked for in time fails (the error names the deadlock); every half gets an
  answer or an error that names the timeout, nothing hangs, and both pools end where they started."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from cluster_helpers_pd import compose_pd
from framework.cluster.cluster import Cluster
from test_pd_cluster import in_background, info, settled, wait_until

pytestmark = pytest.mark.long
TIMEOUT_S = 3


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def crossed_halves(cluster, n: int, new: int, distserve: bool) -> dict:
    """Send A, B, C's decode halves, then B, C, A's prefill halves; (side, name) -> the half's answer, later."""
    prefill, decode = cluster.worker_urls
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_ports[0]}

    def body(k: int, room: int) -> dict:
        return {"text": "".join(chr(97 + (7 * k + i) % 26) for i in range(n)), "bootstrap_room": room, **boot,
                "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}

    rooms = {"A": 101, "B": 102, "C": 103}
    halves = {}
    for name in "ABC":                            # the decode side sees A first: A gets its slots, B and C wait
        halves["decode", name] = in_background(post, decode + "/generate", body(ord(name), rooms[name]))
        wait_until(lambda: info(decode)["kv_receiving"] + info(decode)["kv_waiting_slots"] == "ABC".index(name)
                   + 1, 10, f"the decode worker queued {name}")
    start = info(prefill)["kv_used_tokens"]
    for name in "BCA":                            # the prefill side sees B and C first
        halves["prefill", name] = in_background(post, prefill + "/generate", body(ord(name), rooms[name]))
        if name == "A":
            break
        k = "BC".index(name) + 1
        if distserve:                             # prefilled at once: their KV fills the prefill pool
            wait_until(lambda: info(prefill)["kv_sending"] == k, 10, f"{name} prefilled, held")
        else:                                     # parked until their destinations come, holding no KV
            wait_until(lambda: info(prefill)["kv_bootstrapping"] == k, 10, f"{name} waits for its destination")
            assert info(prefill)["kv_used_tokens"] == start and info(prefill)["kv_sending"] == 0
    return halves


def sizes(cluster) -> tuple[int, int]:
    cap = info(cluster.worker_urls[0])["kv_capacity_tokens_per_rank"]
    n, new = int(cap * 0.37), int(cap * 0.33)     # two held prompts leave no room for a third; the decode
    assert n + new < cap < 2 * (n + new)          # side pre-allocates one request (prompt + its reserve) at a time
    return n, new


def test_crossed_orders_complete_in_sglangs_order_with_no_timeout_and_every_slot_back():
    cfg = compose_pd("router.impl=servelab", "engine.kv_budget_mb=0.4", "engine.schedule_policy=fcfs",
                     "engine.disaggregation_timeout_s=60")
    with Cluster(cfg) as cluster:
        start = {u: settled(u)["kv_used_tokens"] for u in cluster.worker_urls}
        n, new = sizes(cluster)
        t0 = time.monotonic()
        halves = crossed_halves(cluster, n, new, distserve=False)
        got = {k: wait(60) for k, wait in halves.items()}
        assert all("value" in g for g in got.values()), got
        for name in "ABC":
            (dc, dt), (pc, pt) = got["decode", name]["value"], got["prefill", name]["value"]
            assert dc == 200 and pc == 200, (name, dt, pt)
            assert json.loads(dt)["meta_info"]["completion_tokens"] == new
        assert time.monotonic() - t0 < 60, "a timeout played a part"
        assert [info(u)["kv_transfer_failures"] for u in cluster.worker_urls] == [0, 0]
        assert {u: settled(u, timeout=30)["kv_used_tokens"] for u in cluster.worker_urls} == start


def test_crossed_orders_deadlock_in_distserves_order_until_the_timeout_breaks_it_and_every_slot_comes_back():
    cfg = compose_pd("router.impl=servelab", "engine.kv_budget_mb=0.4", "engine.schedule_policy=fcfs",
                     f"engine.disaggregation_timeout_s={TIMEOUT_S}", "engine.disaggregation_order=distserve")
    with Cluster(cfg) as cluster:
        prefill, decode = cluster.worker_urls
        start = {u: settled(u)["kv_used_tokens"] for u in cluster.worker_urls}
        n, new = sizes(cluster)
        halves = crossed_halves(cluster, n, new, distserve=True)
        time.sleep(1.0)
        stuck = info(prefill), info(decode)
        assert stuck[0]["kv_sending"] == 2 and stuck[0]["queued_requests"] == 1      # A cannot get in
        assert stuck[1]["kv_receiving"] == 1 and stuck[1]["kv_waiting_slots"] == 2   # B and C cannot get slots
        t0 = time.monotonic()
        got = {k: wait(4 * TIMEOUT_S + 30) for k, wait in halves.items()}
        assert time.monotonic() - t0 < 4 * TIMEOUT_S + 30, "a half never answered"
        assert all("value" in g for g in got.values()), got
        # the timeouts break the cycle: the decode side's ask for A's KV runs out first (it cancels A's room), which
        # frees its slots for B; whether B (then C) still reaches its held KV before that hold runs out is a race, so
        # each request either went through on both sides or failed with an error that names the timeout or cancel
        reasons = ("engine.disaggregation_timeout_s", "cancelled", "got no request for room")
        failed = []
        for name in "ABC":
            (dc, dt), (pc, pt) = got["decode", name]["value"], got["prefill", name]["value"]
            if dc == 200:
                assert pc == 200 and json.loads(dt)["meta_info"]["completion_tokens"] == new
                continue
            failed.append(name)
            assert any(r in dt for r in reasons) and pc >= 400 and any(r in pt for r in reasons), (dt, pt)
            assert name == "A" or "deadlock" in pt or "cancelled" in pt, pt   # held KV: the cause named
        assert "A" in failed       # nothing dissolved the cycle but a timeout
        assert {u: settled(u, timeout=30)["kv_used_tokens"] for u in cluster.worker_urls} == start
