"""Every registered routing policy honours the interface; every conf/router/*.yaml fits its plugin's Config."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.core.registry import ROUTING
from framework.contracts.routing import SUBSCRIPTIONS, NoWorkerAvailable, RequestView, RoutingPolicy
from framework.serving.router.config import router_schema, split_router_config

CONF = Path(__file__).resolve().parents[2] / "conf" / "router"
WORKERS = ["http://w0:30000", "http://w1:30000", "http://w2:30000"]


@pytest.mark.parametrize("key", ROUTING.keys())
def test_policy_contract(key):
    cls = ROUTING.get(key)
    assert issubclass(cls, RoutingPolicy)
    fields = dataclasses.fields(cls.Config)
    assert fields[0].name == "name" and cls.Config().name == key
    assert all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING for f in fields)
    assert cls.Reasons and all(isinstance(r, str) for r in cls.Reasons)  # the reasons are the policy's own
    assert cls.subscriptions <= set(SUBSCRIPTIONS)

    policy = cls(cls.Config(), seed=1)
    with pytest.raises(NoWorkerAvailable):
        policy.select("hello")
    for w in WORKERS:
        policy.add_worker(w)
    with pytest.raises(ValueError, match="already added"):
        policy.add_worker(WORKERS[0])
    texts = [f"conversation {i % 4}: turn {'x' * i}" for i in range(20)]
    chosen = [policy.select(t) for t in texts]
    assert set(chosen) <= set(WORKERS)
    assert sum(policy.loads.values()) == 20
    d = policy.last_decision
    assert d.worker == chosen[-1] and d.request_chars == len(texts[-1]) and d.reason in cls.Reasons
    assert 0 <= d.matched_chars <= d.request_chars

    assert policy.select("pinned", workers=[WORKERS[2]]) == WORKERS[2]
    assert policy.select(RequestView("pinned view", list(b"pinned view")), workers=[WORKERS[1]]) == WORKERS[1]
    assert policy.last_decision.request_chars == len("pinned view")  # bytes = characters here
    with pytest.raises(ValueError, match="unknown workers"):
        policy.select("x", workers=["http://nowhere"])
    with pytest.raises(TypeError):
        policy.select(b"bytes")  # type: ignore[arg-type]

    for w in chosen + [WORKERS[2], WORKERS[1]] + WORKERS:  # one release too many per worker: counts stop at zero
        policy.on_request_done(w)
    assert policy.loads == dict.fromkeys(WORKERS, 0)

    policy.remove_worker(WORKERS[0])
    assert WORKERS[0] not in {policy.select(t) for t in texts}
    policy.maintain()
    policy.maintain(now=1e9)


def test_round_robin_cycles_in_insertion_order():
    policy = ROUTING.build("round_robin")
    for w in "abc":
        policy.add_worker(w)
    assert [policy.select("t") for _ in range(7)] == list("abcabca")
    assert policy.last_decision.reason == "round_robin"


def test_random_is_reproducible_for_a_seed_and_spreads():
    def picks(seed):
        policy = ROUTING.build("random", seed=seed)
        for w in "abcd":
            policy.add_worker(w)
        return [policy.select("t") for _ in range(400)]

    assert picks(3) == picks(3)
    assert picks(3) != picks(4)
    counts = {w: picks(5).count(w) for w in "abcd"}
    assert all(60 <= c <= 140 for c in counts.values()), counts  # ~100 each; 4+ sigma either way fails


def compose_router(name: str, *overrides: str):
    """Compose ``router=<name>`` with Hydra the way run.py will: each plugin's Config stored as router/<key>_schema."""
    store = ConfigStore.instance()
    for key in ROUTING.keys():
        store.store(group="router", name=f"{key}_schema", node=router_schema(ROUTING.get(key).Config))
    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        return compose(overrides=[f"+router={name}", *overrides]).router


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_router_yaml_composes_and_builds(name):
    node = compose_router(name, "router.port=31000")
    cls = ROUTING.get(node.name)
    cfg, service = split_router_config(OmegaConf.to_object(node))
    assert type(cfg) is cls.Config and service.port == 31000  # the policy gets only its own fields
    policy = cls(cfg)  # the plugin accepts the values
    policy.add_worker("w")
    assert policy.select("hello") == "w"


def test_a_misspelt_router_key_fails_at_composition():
    with pytest.raises(Exception, match="cache_treshold"):
        compose_router("cache_aware", "router.cache_treshold=0.2")


def test_cache_aware_yaml_defaults_match_sglang():
    fields = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "eviction_interval_secs",
              "max_tree_size", "miss_policy")
    v04, v2 = compose_router("cache_aware"), compose_router("cache_aware_v2")
    assert v2.name == "cache_aware"
    assert tuple(v04[f] for f in fields) == (0.5, 32, 1.0001, 60, 2 ** 24, "smallest_tree")
    assert tuple(v2[f] for f in fields) == (0.3, 64, 1.5, 120, 2 ** 26, "least_loaded")
    defaults = ROUTING.get("cache_aware").Config()
    assert tuple(getattr(defaults, f) for f in fields) == (0.5, 32, 1.0001, 60, 2 ** 24, "smallest_tree")
