"""The real path's order is DistServe's: a prefill instance prefills a paired request at once and holds its KV until
the decode side asks for it (framework/engine/disagg.py, framework/instance/kv_connector.py). When the two sides take
requests in different orders (two routers, a network that reorders, or the prefill's lpm policy putting a cached
prefix first) that can deadlock: the decode pool is full of slots pre-allocated for a request the prefill cannot take,
its pool being full of KV held for requests the decode side has no slots for. Here it is built on purpose, on one
prefill and one decode worker, by sending the halves straight to the workers in crossed orders; SGLang's order (the
prefill only after the decode side's slots exist) cannot deadlock so, and the simulator has it (sim.pd_order).

What the real path does about it: `engine.disaggregation_timeout_s` breaks the cycle. The decode side's ask for A's KV
runs out first (it cancels A's room); KV held for B or C that nobody asked for in time fails (the error names the
deadlock); every half gets an answer or an error that names the timeout, nothing hangs, and both pools end where they
started. Preventing it takes SGLang's order on the real path (a prefill
admitted only once its room's destination has come), which is not built."""
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


def test_crossed_orders_deadlock_until_the_timeout_breaks_it_and_every_slot_comes_back():
    cfg = compose_pd("router.impl=servelab", "engine.kv_budget_mb=0.4", "engine.schedule_policy=fcfs",
                     f"engine.disaggregation_timeout_s={TIMEOUT_S}")
    with Cluster(cfg) as cluster:
        prefill, decode = cluster.worker_urls
        start = {u: settled(u)["kv_used_tokens"] for u in cluster.worker_urls}
        cap = info(prefill)["kv_capacity_tokens_per_rank"]
        n, new = int(cap * 0.37), int(cap * 0.33)     # two held prompts leave no room for a third; the decode
        assert n + new < cap < 2 * (n + new)          # side pre-allocates one request (prompt + its reserve) at a time
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
        for name in "BCA":                            # the prefill side sees B and C first: their KV fills its pool
            halves["prefill", name] = in_background(post, prefill + "/generate", body(ord(name), rooms[name]))
            if name != "A":
                wait_until(lambda: info(prefill)["kv_sending"] == "BC".index(name) + 1, 10, f"{name} prefilled, held")
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
