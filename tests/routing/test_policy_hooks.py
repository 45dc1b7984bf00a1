"""What a routing policy declares instead of being known by name: whether it keeps an estimate of the cached prefix
(`keeps_estimate`), how SGLang's router runs it (`sglang_args`, checked by sglang-router's own argument parser), and
the block size of the KV events it reads (`kv_block_size`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from framework.config import compose
from framework.contracts.routing import NotExpressible, RoutingPolicy
from framework.core.registry import ROUTING
from framework.cluster.peer_router import expressible_policies

CONF = Path(__file__).resolve().parents[2] / "conf" / "router"
WORKERS = ["http://w0:1", "http://w1:1", "http://w2:1"]
OPTIONS = sorted(p.stem for p in CONF.glob("*.yaml"))


@pytest.mark.parametrize("key", ROUTING.keys())
def test_a_policy_estimates_exactly_when_it_says_it_keeps_an_estimate(key):
    """Requests that repeat earlier ones: a policy that keeps an estimate credits some of them as cached; one that
    keeps none reports 0 for every decision (what /router_stats' estimated hit rate then means)."""
    cls = ROUTING.get(key)
    policy = cls(cls.Config(), seed=0)
    for w in WORKERS:
        policy.add_worker(w)
    texts = [f"session {i % 3}: " + "shared context of this session " * 4 for i in range(12)]
    matched = []
    for text in texts:
        policy.on_request_done(policy.select(text), policy.last_decision, usage=None)
        matched.append(policy.last_decision.matched_chars)
    assert isinstance(cls.keeps_estimate, bool)
    assert (sum(matched) > 0) == cls.keeps_estimate, matched


def test_the_estimating_policies_say_so():
    keeps = {key for key in ROUTING.keys() if ROUTING.get(key).keeps_estimate}
    assert {"cache_aware", "precise_prefix", "kv_cost"} <= keeps
    assert not keeps & {"round_robin", "random", "power_of_two", "prefix_hash"}


@pytest.mark.parametrize("option", OPTIONS)
def test_sglang_args_parse_with_sglang_routers_own_parser_or_say_why_not(option):
    """Every conf/router option: its `sglang_args` are flags sglang-router's parser reads back as the same policy
    and thresholds, or a NotExpressible reason; a policy that does not implement the hook refuses by default."""
    launch = pytest.importorskip("sglang_router.launch_router")
    rc = compose([f"router={option}"]).router
    cls = ROUTING.get(rc.name)
    try:
        args = cls.sglang_args(rc)
    except NotExpressible as e:
        assert str(e) and "\n" not in str(e)
        return
    assert cls.sglang_args.__func__ is not RoutingPolicy.sglang_args.__func__ and args[0] == "--policy"
    parsed = launch.parse_router_args(["--worker-urls", *WORKERS, *args])
    assert parsed.policy == args[1] and parsed.worker_urls == WORKERS
    for field in ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "eviction_interval_secs",
                  "max_tree_size"):
        if hasattr(rc, field):
            assert getattr(parsed, field) == getattr(rc, field), field


def test_the_policies_sglang_router_runs():
    assert set(expressible_policies()) == {"round_robin", "random", "power_of_two", "cache_aware"}
    with pytest.raises(NotExpressible, match="no policy like router=precise_prefix"):
        ROUTING.get("precise_prefix").sglang_args(compose(["router=precise_prefix"]).router)


def test_kv_block_size_is_the_policy_s_own():
    assert ROUTING.get("precise_prefix").kv_block_size(compose(["router=precise_prefix",
                                                                "router.block_size=8"]).router) == 8
    assert ROUTING.get("cache_aware").kv_block_size(compose(["router=cache_aware"]).router) is None
    assert ROUTING.get("prefix_hash").kv_block_size(compose(["router=prefix_hash"]).router) is None   # no events


def test_the_subscribers_reset_causes_are_the_contracts():
    """framework/kv_events sits below the contracts and names the causes itself: they must be the contract's."""
    from framework.contracts.routing import EVENTS_LOST, RESTARTED
    from framework.kv_events import subscriber
    assert (subscriber.RESTARTED, subscriber.EVENTS_LOST) == (RESTARTED, EVENTS_LOST)
