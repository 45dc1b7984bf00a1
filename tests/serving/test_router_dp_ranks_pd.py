"""P/D pairs under router.dp_aware (sglang's PD router with --dp-aware, sgl-project/sglang#26245): each role's policy
picks a DP group of its worker (dp_size from the worker's /server_info), the prefill half's body names its group in
``data_parallel_rank``, the decode half's names its own and the prefill's (``disagg_prefill_dp_rank``), and the room
lands on the prefill group under SGLang's follow_bootstrap_room (``room % prefill dp_size``). Real HTTP stub workers
on loopback record what each half got. Long: sglang-router 0.3.2 (what router.impl=sglang runs) in P/D mode with
--dp-aware, observed: it registers url@rank workers and sends each half to the url@rank string itself, so every
request fails (the bug sgl-project/sglang#26245 fixed); docs/fidelity.md says so."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from framework.cluster.peer_router import PINNED, PeerRouterError, SglangRouter, installed_version, sglang_router_args
from framework.config import compose
from framework.core.ports import free_ports
from framework.core.registry import ROUTING
from framework.routing.dp_aware import DP_RANK_HEADER
from framework.routing.pairs import DECODE, PREFILL
from framework.serving.router.config import RouterServiceConfig, split_router_config
from framework.serving.router.pd import aligned_room
from framework.serving.router.service import start_router
from serving_helpers import serve, url_of, wait_until

pytestmark = pytest.mark.anyio
P_DP, D_DP = 2, 3


def stub(info: dict, got: list) -> web.Application:
    """A worker of one role: its /server_info, and /generate recording (body, X-Data-Parallel-Rank) per request."""
    async def health(request):
        return web.json_response({"status": "ok"})

    async def server_info(request):
        return web.json_response(info)

    async def generate(request):
        got.append((await request.json(), request.headers.get(DP_RANK_HEADER)))
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/generate", generate)
    return app


def test_aligned_room_keeps_the_room_and_moves_its_remainder():
    assert aligned_room(1001, None, 4) == 1001 and aligned_room(1001, 0, 1) == 1001
    assert [aligned_room(1001, r, 4) % 4 for r in range(4)] == [0, 1, 2, 3]
    assert all(aligned_room(2**63 - 1, r, 7) < 2**64 for r in range(7))


@pytest.mark.parametrize("dp_aware", [True, False])
async def test_a_dp_aware_pair_sends_each_side_its_rank(dp_aware):
    p_got, d_got = [], []
    boot = free_ports("127.0.0.1", 1)[0]     # advertised, never opened (the stubs do no KV transfer)
    prefill = await serve(stub({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": boot,
                                "dp_size": P_DP}, p_got))
    decode = await serve(stub({"disaggregation_mode": "decode", "dp_size": D_DP}, d_got))
    cls = ROUTING.get("round_robin")
    server = await start_router(cls(cls.Config()), [url_of(prefill), url_of(decode)], RouterServiceConfig(
        health_check_interval_secs=0.05, dp_aware=dp_aware), port=0)
    try:
        core = server.router.core
        if dp_aware:
            await wait_until(lambda: core.role_policies[PREFILL].sizes.get(url_of(prefill)) == P_DP
                             and core.role_policies[DECODE].sizes.get(url_of(decode)) == D_DP,
                             what="each role's policy to learn its worker's dp_size")
        else:
            await wait_until(lambda: server.router.pd.active and len(core.role_policies[DECODE].loads) == 1,
                             what="the roles")
        n = 6
        async with aiohttp.ClientSession(server.url) as http:
            for i in range(n):
                async with http.post("/generate", json={"text": f"request {i}"}) as r:
                    assert r.status == 200, await r.text()
        await wait_until(lambda: len(p_got) == n, what="every prefill half")
        await asyncio.sleep(0)
        assert len(d_got) == n
        by_room = {body["bootstrap_room"]: (body, header) for body, header in p_got}
        pairs = [(by_room[body["bootstrap_room"]], (body, header)) for body, header in d_got]
        if not dp_aware:      # as before: both halves the same body, no group named
            assert all(p[0] == d[0] and "data_parallel_rank" not in d[0] and d[1] is None for p, d in pairs)
            return
        p_ranks = [p["data_parallel_rank"] for (p, _), _ in pairs]
        d_ranks = [d["data_parallel_rank"] for _, (d, _) in pairs]
        assert p_ranks == [i % P_DP for i in range(n)] and d_ranks == [i % D_DP for i in range(n)]   # round robin
        for (p, p_header), (d, d_header) in pairs:
            assert d["disagg_prefill_dp_rank"] == p["data_parallel_rank"]      # where the decode side's KV comes from
            assert d["bootstrap_room"] % P_DP == p["data_parallel_rank"]      # follow_bootstrap_room agrees
            assert d_header == str(d["data_parallel_rank"]) and p_header is None
            assert "disagg_prefill_dp_rank" not in p
            assert {k: v for k, v in p.items() if k != "data_parallel_rank"} == \
                {k: v for k, v in d.items() if k not in ("data_parallel_rank", "disagg_prefill_dp_rank")}
        await wait_until(lambda: not any(core.role_policies[PREFILL].inner.loads.values())
                         and not any(core.role_policies[DECODE].inner.loads.values()),
                         what="each group's count to settle")
    finally:
        await server.cleanup()
        await prefill.close()
        await decode.close()



async def test_a_decode_worker_that_prefills_locally_gets_its_group_in_the_header():
    """decode_first keeps a short prompt on its decode worker (no prefill half, no bootstrap fields): under
    router.dp_aware the decode group goes in X-Data-Parallel-Rank, as in the single-role path."""
    p_got, d_got = [], []
    boot = free_ports("127.0.0.1", 1)[0]
    prefill = await serve(stub({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": boot,
                                "dp_size": P_DP}, p_got))
    decode = await serve(stub({"disaggregation_mode": "decode", "dp_size": D_DP,
                               "disaggregation_local_prefill": True}, d_got))
    cls = ROUTING.get("round_robin")
    server = await start_router(cls(cls.Config()), [url_of(prefill), url_of(decode)], RouterServiceConfig(
        health_check_interval_secs=0.05, dp_aware=True, pd_decider="decode_first", pd_local_prefill_max_tokens=100),
        port=0)
    try:
        core = server.router.core
        await wait_until(lambda: core.role_policies[DECODE].sizes.get(url_of(decode)) == D_DP,
                         what="the decode worker's dp_size")
        async with aiohttp.ClientSession(server.url) as http:
            for i in range(D_DP):
                async with http.post("/generate", json={"text": f"short {i}"}) as r:
                    assert r.status == 200, await r.text()
        assert p_got == [] and [h for _, h in d_got] == [str(r) for r in range(D_DP)]
        assert all("bootstrap_room" not in b and "data_parallel_rank" not in b for b, _ in d_got)
    finally:
        await server.cleanup()
        await prefill.close()
        await decode.close()


@pytest.mark.long
@pytest.mark.skipif(installed_version() is None, reason="sglang-router is not installed ('.[peers]')")
async def test_sglang_router_0_3_2_in_pd_mode_with_dp_aware_sends_to_url_at_rank_and_fails():
    p_got, d_got = [], []
    boot, port, prom = free_ports("127.0.0.1", 3)
    prefill = await serve(stub({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": boot,
                                "dp_size": P_DP}, p_got))
    decode = await serve(stub({"disaggregation_mode": "decode", "dp_size": D_DP}, d_got))
    policy_cfg, service = split_router_config(compose(["router=round_robin", "router.dp_aware=true"]).router)
    service.host = "127.0.0.1"
    args = sglang_router_args(policy_cfg, service, [], port, prom, pd=([(url_of(prefill), boot)], [url_of(decode)]))
    assert "--dp-aware" in args
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def post(i: int) -> int:
        req = urllib.request.Request(url + "/generate", json.dumps({"text": f"request {i}"}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        expected = {f"{url_of(prefill)}@{r}" for r in range(P_DP)} | {f"{url_of(decode)}@{r}" for r in range(D_DP)}

        async def registered() -> bool:     # each worker as url@rank, healthy: its P/D mode took --dp-aware
            try:
                body = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/workers", timeout=1).read())
            except OSError:
                return False
            workers = json.loads(body)["workers"]
            return {w["url"] for w in workers if w["is_healthy"]} == expected
        await wait_until(registered, timeout=60, what="sglang-router to register every url@rank")
        statuses = [await asyncio.to_thread(post, i) for i in range(4)]
        assert all(s >= 500 for s in statuses), statuses      # no half reached a real URL
        assert p_got == [] and d_got == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        await prefill.close()
        await decode.close()


@pytest.mark.skipif(installed_version() != PINNED, reason=f"sglang-router {PINNED} is not installed ('.[peers]')")
def test_router_impl_sglang_refuses_pd_with_dp_aware_naming_the_bug():
    policy_cfg, service = split_router_config(compose(["router=round_robin", "router.dp_aware=true"]).router)
    with pytest.raises(PeerRouterError, match="every request fails .* router.impl=servelab"):
        SglangRouter(policy_cfg, service, [], 5.0, pd=([("http://127.0.0.1:1", 2)], ["http://127.0.0.1:3"]))
