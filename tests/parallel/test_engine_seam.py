"""One engine seam: a one-rank engine and a multi-rank instance are the same EngineHandle, the in-process driver and
the HTTP worker report the same keys from one statistics builder, and bad memory budgets fail before any rank."""
import json

import pytest

from framework.app import run
from framework.core.errors import UserError
from framework.dist.group import Group
from framework.instance.client import InstanceClient, local_client
from framework.engine.engine import Engine
from framework.instance.handle import SyncFace
from framework.instance.client import InstanceClient
from framework.engine.request import Req, SamplingParams
from framework.core.registry import PARALLELISM
from parallel_helpers import assert_no_rank_left, make_cfg

PROMPTS = ["one engine seam", "x", "a request per rank and a request per group"]
CLUSTER_ONLY = {"workers", "load_imbalance", "router_decision_p50_us", "router_decision_p99_us", "router_retries",
                "router_estimated_hit_rate", "router_confirmed_hit_rate", "router_reasons", "per_worker",
                "client_retries", "worker_load_timeline", "worker_restarts", "router_restarts", "workers_given_up",
                "server_process_cpu_s"}   # the HTTP workers' processes' CPU: no server process in-process


def test_a_one_rank_engine_is_an_instance_handle_and_serves_what_stepping_it_directly_does():
    cfg = make_cfg("engine.kv_budget_mb=1")
    direct = Engine(cfg.model, cfg.engine, PARALLELISM.build("single", cfg.parallel, Group()), cfg.moe, cfg.seed)
    expect = [Req(direct.tokenizer.encode(p), SamplingParams(max_new_tokens=5, ignore_eos=True)) for p in PROMPTS]
    for r in expect:
        direct.add(r)
    while direct.scheduler.has_work():                                   # the oracle: stepped in this thread
        direct.step()
    client = local_client(Engine(cfg.model, cfg.engine, PARALLELISM.build("single", cfg.parallel, Group()),
                                 cfg.moe, cfg.seed))
    assert isinstance(client, InstanceClient)
    face = SyncFace(client)
    got = [Req(client.tokenizer.encode(p), SamplingParams(max_new_tokens=5, ignore_eos=True)) for p in PROMPTS]
    for r in got:
        face.add(r)
    face.wait_all(got, timeout=60)
    final = client.close()
    assert [r.output_ids for r in got] == [r.output_ids for r in expect]
    assert final["requests_per_rank"] == [3] and final["parallel"] == "single" and final["running_requests"] == 0
    assert final["kv_capacity_tokens_instance"] == final["kv_capacity_tokens_per_rank"] == direct.capacity
    with pytest.raises(RuntimeError, match="engine is down: the instance was closed"):
        face.add(Req([1, 2], SamplingParams(max_new_tokens=1)))


@pytest.mark.long
def test_in_process_and_http_runs_report_the_same_engine_keys(tmp_path):
    """The headline command's scheme (DP attention over 2 ranks, expert parallelism), one instance both ways: the
    same keys, the same memory figures, expert load included (multi-rank workers used to drop it)."""
    common = ["parallel=dp_attn", "moe=ep", "router=cache_aware", "cluster.instances=1", "workload.num_conversations=3",
              "workload.turns=2", "workload.output_len=4", "router.port=0"]  # free ports, chosen by the cluster
    results = {}
    for http in (False, True):
        out = tmp_path / f"http_{http}"
        run(make_cfg(*common, f"cluster.http={str(http).lower()}"), str(out), {})
        results[http] = json.loads((out / "results.json").read_text())
    inproc, over_http = results[False], results[True]
    assert set(over_http) - set(inproc) == CLUSTER_ONLY and set(inproc) <= set(over_http)
    for key in ("parallel", "parallel_size", "dp_size", "ffn_comm", "kv_sizing", "weight_bytes_per_rank",
                "kv_bytes_per_token_per_rank", "kv_capacity_tokens_per_rank", "kv_capacity_tokens_instance",
                "requests_completed"):
        assert inproc[key] == over_http[key], key
    assert (inproc["parallel"], inproc["parallel_size"], inproc["dp_size"]) == ("dp_attn", 2, 2)
    for res in (inproc, over_http):
        assert res["requests_completed"] == 6
        # the run's, not the warm-up's: the stats that come with the last finish count every request
        assert sum(res["requests_per_rank"]) == res["requests_completed"]
        assert res["moe_layer1_routed_slots"] > 0 and "moe_layer1_ep_rank_imbalance" in res
    assert_no_rank_left([])


def test_a_memory_budget_below_the_weights_fails_before_any_rank_starts(tmp_path):
    cfg = make_cfg("parallel=dp_attn", "engine.mem_budget_mb=2", "cluster.http=false")
    with pytest.raises(UserError, match=r"engine.mem_budget_mb=2 leaves no KV on a rank: its weights take \d+\.\d+ MB "
                                        r"under parallel=dp_attn x2, moe=reference; raise engine.mem_budget_mb"):
        run(cfg, str(tmp_path), {})
    assert_no_rank_left([])


def test_a_one_token_request_drains_the_instance_with_stats_that_count_its_step():
    """A request added and finished in one step (max_new_tokens=1: its extend samples its only token) still drains
    the instance with fresh stats: a client reading them at the finish sees that step's CPU and count (experiments/
    calibrate/contention.py times single extends so)."""
    from framework.instance.client import open_engine
    from framework.instance.rank_loop import InstanceSpec
    cfg = make_cfg("engine.kv_budget_mb=1")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))   # its rank loop
    face = SyncFace(client)
    try:
        for n in range(1, 4):
            req = Req(client.tokenizer.encode(f"prompt {n} " * 8), SamplingParams(max_new_tokens=1, ignore_eos=True))
            face.add(req)
            face.wait_all([req], timeout=60)
            stats = client.stats()
            assert (stats["extend_steps"], stats["decode_steps"], len(req.output_ids)) == (n, 0, 1)
            assert stats["extend_cpu_s"] > 0
    finally:
        client.close()
        client.terminate()
