"""One routing policy instance per role in P/D mode (sglang-router 0.3.2's --prefill-policy/--decode-policy, each
defaulting to --policy): framework/routing/core.py set_role_policies/set_role, framework/routing/pairs.py
role_policies; the HTTP router (pd.py) and mode=sim (framework/sim/pd.py) both use them."""
from __future__ import annotations


import pytest

from framework.cluster.peer_router import sglang_router_args
from framework.config import compose
from framework.contracts.routing import RequestView
from framework.core.registry import ROUTING, WORKLOAD
from framework.routing.core import RouterCore
from framework.routing.pairs import ALWAYS, DECODE, DECODE_FIRST, PREFILL, dispatch_pair, role_policies
from framework.runs.sim import build
from framework.serving.router.config import RouterServiceConfig, split_router_config

P = ["http://p0:1", "http://p1:1"]
D = ["http://d0:1", "http://d1:1", "http://d2:1"]


def _core(name="cache_aware", prefill=None, decode=None):
    cls = ROUTING.get(name)
    core = RouterCore(cls(cls.Config(), seed=3), clock=lambda: 0.0)
    for u in P + D:
        core.add_worker(u, healthy=True)
    core.set_role_policies(role_policies(core.policy, prefill, decode))
    for u in P:
        core.set_role(u, PREFILL)
    for u in D:
        core.set_role(u, DECODE)
    return core


def _pair(core, text, decider=ALWAYS):
    return dispatch_pair(core, text, [core.workers[u] for u in P], [core.workers[u] for u in D], decider)


@pytest.mark.parametrize("decider", [ALWAYS, DECODE_FIRST])
def test_each_role_policy_holds_only_its_role_workers_requests_and_state(decider):
    core = _core()
    pp, dp = core.role_policies[PREFILL], core.role_policies[DECODE]
    assert pp is not dp and pp is not core.policy and type(pp) is type(dp) is type(core.policy)
    assert list(pp.loads) == P and list(dp.loads) == D and not core.policy.loads    # the router's own holds none now
    plans = [_pair(core, f"conversation {i % 3}: " + "x" * 40 * (i % 3 + 1), decider) for i in range(9)]
    assert all(pl.prefill.worker.url in P and pl.decode.worker.url in D for pl in plans)
    assert sum(pp.loads.values()) == 9 and sum(dp.loads.values()) == 9
    assert sum(core.workers[u].in_flight for u in P + D) == 18          # WorkerState reads its role policy's counts
    # each tree learnt its own role's prompts on its own workers, nothing on the other role's
    assert pp.tree.total_chars > 0 and dp.tree.total_chars > 0 and core.policy.tree.total_chars == 0
    assert set(pp._tenant_keys) <= set(P) and set(dp._tenant_keys) <= set(D)
    # the same conversation comes back to the worker that holds it, on each side independently
    again = _pair(core, "conversation 1: " + "x" * 80, decider)
    assert again.prefill.worker.url == plans[1].prefill.worker.url
    assert again.decode.worker.url == plans[1].decode.worker.url
    for pl in [*plans, again]:
        pl.prefill.served = pl.decode.served = True
        core.release(pl.prefill)
        core.release(pl.decode)
    assert not any(pp.loads.values()) and not any(dp.loads.values())
    assert core.snapshot()["role_policy_state"][PREFILL]["tree_chars"] == pp.tree.total_chars


def test_a_named_role_policy_replaces_the_routers_on_that_side_only():
    core = _core("cache_aware", prefill="round_robin")
    assert type(core.role_policies[PREFILL]).__name__ != type(core.policy).__name__
    assert type(core.role_policies[DECODE]) is type(core.policy)
    plans = [_pair(core, "same prompt") for _ in range(4)]
    assert [pl.prefill.worker.url for pl in plans] == [P[0], P[1], P[0], P[1]]   # round robin, its own position
    assert len({pl.decode.worker.url for pl in plans}) == 1                       # cache-aware keeps the prompt home


def test_a_worker_whose_role_changes_moves_with_its_in_flight_count():
    core = _core("round_robin")
    plan = _pair(core, "x")
    u = plan.decode.worker.url
    core.set_role(u, "mixed")                      # e.g. restarted as a mixed worker: back to the router's policy
    assert core.policy.loads[u] == 1 and u not in core.role_policies[DECODE].loads and core.workers[u].in_flight == 1
    core.release(plan.decode)
    assert core.policy.loads[u] == 0


def test_an_unknown_role_policy_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="router.prefill_policy='nope' is not a routing policy; the choices: .*"
                                         "round_robin"):
        RouterServiceConfig(prefill_policy="nope").validate()


def test_mode_sim_routes_each_role_with_its_own_policy():
    cfg = compose(["mode=sim", "logger.mode=disabled", "workload=random", "workload.num_prompts=8",
                   "workload.max_concurrency=4", "cluster.instances=4", "cluster.roles=[prefill,prefill,decode,decode]",
                   "router=cache_aware", "router.decode_policy=round_robin"])
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    sim = build(cfg, sessions)
    core = sim.router.core
    records, _ = sim.run()
    assert len(records) == 8 and all(r.ok for r in records)
    pp, dp = core.role_policies[PREFILL], core.role_policies[DECODE]
    assert set(pp.loads) == set(sim.pd.prefill) and set(dp.loads) == set(sim.pd.decode)
    assert type(dp).__name__ == type(ROUTING.get("round_robin")()).__name__ and pp.tree.total_chars > 0
    assert sorted(r.worker for r in records) == sorted(sim.pd.decode * 4)   # round robin over the decode side
    assert not any(pp.loads.values()) and not any(dp.loads.values()) and not core.policy.loads


def test_sglang_router_gets_the_role_policies_as_its_pd_flags():
    rc = compose(["router=cache_aware_v2", "router.decode_policy=round_robin"]).router
    policy_cfg, service = split_router_config(rc)
    args = sglang_router_args(policy_cfg, service, [], 1, 2, pd=([("http://p:1", 9)], ["http://d:1"]))
    assert args[args.index("--policy") + 1] == "cache_aware"        # (cache_aware_v2: sglang-router's own defaults)
    assert args[args.index("--decode-policy") + 1] == "round_robin" and "--prefill-policy" not in args
    assert "--decode-policy" not in sglang_router_args(policy_cfg, service, ["http://w:1"], 1, 2)   # no P/D: no roles


def test_the_routers_pd_switch_follows_roles_without_scanning_the_workers():
    """pd.py's per-request check (any prefill or decode worker?) reads the role policies, not every worker: it must
    agree with the scan through roles learnt, a worker gone back to mixed, removed and added again."""
    from framework.serving.router.pd import has_pd_workers
    cls = ROUTING.get("round_robin")
    core = RouterCore(cls(cls.Config(), seed=3), clock=lambda: 0.0)
    core.set_role_policies(role_policies(core.policy))

    def scan():
        return any(w.role in (PREFILL, DECODE) for w in core.workers.values())

    steps = [lambda: core.add_worker(P[0], healthy=True), lambda: core.add_worker(D[0], healthy=True),
             lambda: core.set_role(P[0], "mixed"), lambda: core.set_role(D[0], DECODE),
             lambda: core.remove_worker(D[0]), lambda: core.add_worker(D[0], healthy=True),
             lambda: core.set_role(P[0], PREFILL), lambda: core.set_role(P[0], None), lambda: core.remove_worker(P[0]),
             lambda: core.remove_worker(D[0])]
    seen = []
    for step in steps:
        step()
        assert has_pd_workers(core) == scan()
        seen.append(scan())
    assert True in seen and seen[-1] is False and seen[2] is False


@pytest.mark.parametrize("router, decode", [("token_jsq", "token_jsq"), ("cache_aware", "mixed_pool")])
def test_a_worker_that_changes_role_with_a_request_in_flight_leaves_both_policies_whole(router, decode):
    """The request was decided by the router's policy; when its worker moves to the decode role's policy meanwhile
    (pd.discover learns roles late), its end still releases the count there, and no policy reads a decision another
    one made (a token_jsq count would go negative, mixed_pool would read a foreign memo)."""
    cls = ROUTING.get(router)
    core = RouterCore(cls(cls.Config(), seed=3), clock=lambda: 0.0)
    core.add_worker(D[0], healthy=True)
    core.set_role_policies(role_policies(core.policy, None, decode))
    att = core.dispatch(RequestView("x" * 10, list(range(10))))
    core.set_role(D[0], DECODE)
    moved = core.policy_of(D[0])
    assert moved is not att.policy and moved.loads[D[0]] == 1
    core.release(att)
    assert moved.loads[D[0]] == 0
    assert all(v == 0 for v in getattr(moved, "pending", {}).values())
    assert all(v == 0 for v in getattr(moved, "reserved", {}).values())
