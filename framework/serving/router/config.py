"""The router service's settings, apart from the routing policy's, and the one schema users type both into.

Users write every router setting as ``router.<key>``: the policy's own (``router.cache_threshold``) and the service's
(``router.port``, ``router.max_retries``). The schema Hydra stores for ``router=<key>`` is therefore a dataclass
combining the plugin's ``Config`` with ``RouterServiceConfig`` (``router_schema``); ``split_router_config`` cuts a
composed object back into the two, so a policy is built with only its own fields and the service with its own.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field, fields
from typing import Optional

from framework.core.registry import ROUTING

_SCHEMA_SUFFIX = "RouterSchema"


class RouterImpl(enum.Enum):
    """Which router process fronts the workers: servelab's own, or SGLang's (framework/cluster/peer_router.py)."""
    servelab = "servelab"
    sglang = "sglang"


@dataclass
class RouterServiceConfig:
    """How the router service runs, whatever the policy. Deadlines are per client request, over all its attempts;
    ``request_timeout_s`` is per attempt on a stream (a worker silent that long is given up on)."""
    impl: RouterImpl = RouterImpl.servelab  # sglang: SGLang's router (sglang-router 0.3.2) with this policy
    host: str = "127.0.0.1"
    port: int = 30000                       # 0: free ports for the router and the local workers
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 2.0
    max_retries: int = 3                    # extra attempts after the first (another worker when there is one)
    retry_backoff_base_s: float = 0.05      # retry k waits in [d/2, d], d = min(max, base * 2**(k-1)) (or Retry-After)
    retry_backoff_max_s: float = 2.0
    breaker_failure_threshold: int = 5      # consecutive failures (connection errors, 5xx but 503) that open a breaker
    breaker_cooldown_secs: float = 30.0     # open -> half-open (one probe request) after this long
    request_timeout_s: float = 600.0        # longest a streaming worker may stay silent (no head / no next chunk)
    first_byte_timeout_s: float = 600.0     # a client request's first response byte (non-streaming: all of it)
    total_timeout_s: float = 3600.0         # a client request's whole response, from its arrival
    abort_timeout_s: float = 2.0            # how long a silent worker has to confirm it aborted a request
    connect_timeout_s: float = 5.0
    drain_timeout_secs: float = 600.0       # remove_worker waits this long for in-flight requests at most
    maintain_interval_secs: float = 1.0     # how often the policy's periodic work (cache eviction) runs
    client_max_size: int = 8 * 2**20        # request body limit, bytes (larger: a 413 JSON error)
    # where a worker's KV events are when it does not say (vLLM: --kv-events-config publishes on tcp://*:5557); 0: none
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_events_dp_size: int = 0              # its DP ranks, each on port + rank, when /get_server_info does not say
    load_poll_interval_s: float = 0.5       # GET /get_load on every worker this often (a policy that follows loads)
    # sgl-router's --dp-aware (framework/routing/dp_aware.py): the policy picks a (worker, DP group), sent as the pin
    dp_aware: bool = False
    # admission control, sglang-router 0.3.2's flags and semantics (admission.py); -1: no limit
    max_concurrent_requests: int = -1
    queue_size: int = 100                   # requests waiting for admission at most (0: refuse at once, 429)
    queue_timeout_secs: float = 60.0        # longest wait for admission (then 408)
    rate_limit_tokens_per_second: Optional[float] = None  # token refill rate; None: max_concurrent_requests
    # the front door (security.py, docs/router-security.md): defaults serve loopback, open, plain HTTP
    api_key: Optional[str] = None           # data plane: Authorization: Bearer <api_key>
    control_plane_api_keys: list[str] = field(default_factory=list)  # 'id:name:role:key', role admin | user
    control_plane_audit_enabled: bool = True  # an audit log line per control action (SGLang's default: off)
    tls_cert_path: Optional[str] = None     # both set: HTTPS
    tls_key_path: Optional[str] = None
    cors_allowed_origins: list[str] = field(default_factory=list)  # origins (or "*") browsers may call from
    request_id_headers: list[str] = field(default_factory=list)  # where a client's request id is; []: SGLang's list
    # prefill/decode disaggregation (pd.py; framework/routing/pairs.py): each worker's role comes from its
    # GET /server_info; with prefill and decode workers every request goes to a pair, or, per the decider, to a
    # decode worker alone (one started with engine.disaggregation_local_prefill=true)
    pd_decider: str = "always"              # always (sglang-router's) | decode_first (llm-d) | conditional (Dynamo)
    pd_local_prefill_max_tokens: int = 256  # decode_first, conditional: up to this many uncached tokens prefill locally
    pd_max_prefill_queue: int = 2           # conditional: remote only while a prefill worker has fewer in flight
    pd_bytes_per_token: float = 1.0         # the prompt's tokens from its text when the client sent no ids (byte model)
    # one policy instance per role (sglang-router's --prefill-policy/--decode-policy): a routing policy's name, with
    # its default settings; null: the router's own policy (router=...) and settings, a separate instance per role
    prefill_policy: Optional[str] = None
    decode_policy: Optional[str] = None

    def validate(self) -> None:
        problems = []
        positive = ("health_check_interval_secs", "health_check_timeout_secs", "request_timeout_s",
                    "first_byte_timeout_s", "total_timeout_s", "abort_timeout_s", "connect_timeout_s",
                    "drain_timeout_secs", "maintain_interval_secs", "client_max_size", "load_poll_interval_s")
        problems += [f"router.{n} must be > 0, got {getattr(self, n)}" for n in positive if getattr(self, n) <= 0]
        non_negative = ("max_retries", "retry_backoff_base_s", "retry_backoff_max_s", "breaker_cooldown_secs",
                        "kv_events_port", "kv_events_replay_port", "kv_events_dp_size")
        problems += [f"router.{n} must be >= 0, got {getattr(self, n)}" for n in non_negative if getattr(self, n) < 0]
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            problems.append(f"router.max_concurrent_requests must be -1 (no limit) or >= 1, got "
                            f"{self.max_concurrent_requests}")
        if self.queue_size < 0 or self.queue_timeout_secs <= 0:
            problems.append(f"router.queue_size must be >= 0 and router.queue_timeout_secs > 0, got "
                            f"{self.queue_size} and {self.queue_timeout_secs}")
        if self.rate_limit_tokens_per_second is not None and self.rate_limit_tokens_per_second <= 0:
            problems.append(f"router.rate_limit_tokens_per_second must be > 0 (or null), got "
                            f"{self.rate_limit_tokens_per_second}")
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            problems.append("router.tls_cert_path and router.tls_key_path go together (PEM files); got only one")
        if self.api_key == "":
            problems.append("router.api_key must not be empty (null: no key)")
        try:
            from framework.serving.router.security import parse_control_keys
            parse_control_keys(self.control_plane_api_keys)
        except ValueError as e:
            problems.append(str(e))
        from framework.routing.pairs import DECIDERS
        for key in ("prefill_policy", "decode_policy"):
            name = getattr(self, key)
            if name is not None and name not in ROUTING.keys():
                problems.append(f"router.{key}={name!r} is not a routing policy; the choices: "
                                f"{', '.join(sorted(k for k in ROUTING.keys()))} (null: the router's own)")
        if self.pd_decider not in DECIDERS:
            problems.append(f"router.pd_decider={self.pd_decider!r}: one of {', '.join(DECIDERS)}")
        if self.pd_local_prefill_max_tokens < 0 or self.pd_max_prefill_queue < 0 or self.pd_bytes_per_token <= 0:
            problems.append(f"router.pd_local_prefill_max_tokens and router.pd_max_prefill_queue must be >= 0 and "
                            f"router.pd_bytes_per_token > 0, got {self.pd_local_prefill_max_tokens}, "
                            f"{self.pd_max_prefill_queue} and {self.pd_bytes_per_token}")
        if self.breaker_failure_threshold < 1:
            problems.append(f"router.breaker_failure_threshold must be >= 1, got {self.breaker_failure_threshold}")
        if problems:
            raise ValueError("; ".join(problems))


SERVICE_FIELDS = frozenset(f.name for f in fields(RouterServiceConfig))
_schemas: dict[type, type] = {}


def router_schema(policy_config: type) -> type:
    """The ``router`` group's schema for one plugin: its Config's fields first, then the service's (built once per
    plugin; picklable by name through this module's ``__getattr__``)."""
    schema = _schemas.get(policy_config)
    if schema is None:
        clash = SERVICE_FIELDS.intersection(f.name for f in fields(policy_config))
        if clash:
            raise ValueError(f"{policy_config.__qualname__} declares {sorted(clash)}, which are router service "
                             f"settings (framework/serving/router/config.py); rename the policy's fields")
        schema = dataclasses.make_dataclass(policy_config.__name__ + _SCHEMA_SUFFIX, [],
                                            bases=(RouterServiceConfig, policy_config))
        schema.__module__ = __name__
        schema._policy_config = policy_config
        _schemas[policy_config] = schema
    return schema


def split_router_config(cfg) -> tuple[object, RouterServiceConfig]:
    """A composed ``router`` object -> (the policy's own Config, the checked service settings). A plain policy Config
    (no service fields) gets the default service settings."""
    policy_config = getattr(type(cfg), "_policy_config", type(cfg))
    policy = policy_config(**{f.name: getattr(cfg, f.name) for f in fields(policy_config)})
    service = RouterServiceConfig(**{n: getattr(cfg, n) for n in SERVICE_FIELDS if hasattr(cfg, n)})
    service.validate()
    return policy, service


def __getattr__(name: str) -> type:
    """``<PolicyConfig>RouterSchema`` for pickle in a fresh process (multirun launchers, spawned children): found by
    the policy Config's class name among the registered routing plugins."""
    if name.endswith(_SCHEMA_SUFFIX):
        wanted = name[: -len(_SCHEMA_SUFFIX)]
        for key in ROUTING.keys():
            config = ROUTING.get(key).Config
            if config.__name__ == wanted:
                return router_schema(config)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
