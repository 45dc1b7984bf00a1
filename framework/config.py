"""Typed configuration: every group's schema lives in Hydra's ConfigStore, so a misspelt key or a wrong type
fails at start. Plugin schemas are each plugin's own `Config` dataclass, found through the registries."""
from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from framework.engine.config import EngineConfig
from framework.model.config import ModelConfig
from framework.core.registry import COST, MOE, PARALLELISM, ROUTING, WORKLOAD
from framework.gpu.hardware import HardwareConfig
from framework.report.wandb_log import LogMode, LoggerConfig
from framework.sim.answers import SimAnswers

PLUGIN_GROUPS = {"parallel": PARALLELISM, "moe": MOE, "router": ROUTING, "workload": WORKLOAD, "sim/cost": COST}


class Mode(enum.Enum):
    bench = "bench"     # run the workload, report results
    verify = "verify"   # check every path's logits against the single-process reference
    serve = "serve"     # keep the cluster up for clients
    sim = "sim"         # the discrete-event simulator


@dataclass
class ClusterConfig:
    instances: int = 1                # local engine instances
    workers: list[str] = field(default_factory=list)   # URLs of external servers to route to instead
    url: str = ""                     # client-only: drive this server (started elsewhere) and start nothing
    http: bool = True                 # workers + router over HTTP; False: the in-process driver on one instance
    worker_ports: list[int] = field(default_factory=list)   # local workers' ports; default: free ones (router.port=0)
                                      # or router.port+1, +2, ... (a fixed router.port)
    startup_timeout_s: float = 120.0  # every worker and the router must answer /health within this
    request_timeout_s: float = 300.0  # the load client's bound per request, all its tries together
    client_retries: int = 2           # the load client re-sends a request whose stream broke (its worker died)
    restart_workers: bool = True      # restart a worker or the router that dies (framework/cluster/supervisor.py)
    max_restarts: int = 5             # ...at most this many times each within restart_window_s, then give up on it
    restart_window_s: float = 300.0
    restart_backoff_s: float = 0.5    # the wait before a restart, doubling with each restart in the window (<= 30 s)
    kv_events: bool = False           # local workers publish KV events (on anyway for a router= that follows them)
    kv_block_size: int = 16           # ...in blocks of this many tokens (such a router's router.block_size too)
    roles: list[str] = field(default_factory=list)   # per local instance: mixed | prefill | decode (empty: all mixed)


@dataclass
class VerifyConfig:
    atol: float = 1e-4                # max abs logit error allowed (fp32)
    max_new_tokens: int = 6


@dataclass
class SimConfig:
    """mode=sim (framework/sim/): what the simulator adds to the run's config."""
    cost: Any = None                  # the cost model's Config (group sim/cost: `sim.cost=calibrated|roofline`)
    host_cores: int = 0               # 0: each instance on its own GPUs; N: every rank (and, over HTTP, the router and
                                      # the load client) shares N CPU cores (a CPU host: framework/sim/cluster.py)
    host_background: float = 0.0      # with host_cores: other work's busy processes on those cores (what a real run
                                      # beside it shared them with: experiments/sim_fidelity measures it)
    # with host_cores, over HTTP: the router process and the load client, as busy processes while any request is in
    # flight; measured 0.05 (0.28 CPU-s of both over a 5.9-s multi-turn cache-aware run of 4 workers, /proc); 2 was
    # an unmeasured guess (both fully busy)
    host_side_procs: float = 0.05
    # with host_cores: how the busy processes share the cores (framework/sim/cluster.py): at_start (a step keeps the
    # stretch of its start) | fair (processor sharing, re-timed as the busy processes change: work-conserving)
    host_sharing: str = "at_start"
    # with host_cores: how much slower each busy core runs once every core is busy than with one busy (cores that
    # share a physical core or its caches: this VM's 2 measured 0.93-1.25x at different times, framework/core/host_probe.contention); 1: none
    host_contention: float = 1.0
    host_contention_extend: Optional[float] = None   # extend steps' own factor (None: host_contention's)
    # the busy processes the factors were measured with (None: host_cores, every core busy, as host_probe measures
    # them); the slowing grows linearly from 1 busy to it and stays there (experiments/calibrate/contention.py: 4)
    host_contention_busy: Optional[float] = None
    # with host_cores: the cores' time the hypervisor gives to other guests (steal, /proc/stat), in cores. Each core
    # runs 1 - host_steal / host_cores of the time, and an instance's ranks, which meet at every collective, advance
    # only while every one of their cores runs (framework/sim/cluster.py); 0: none (or counted in host_background)
    host_steal: float = 0.0
    # an idle instance starts its step once every request arriving at that instant is in (SGLang's loop takes in all
    # it has received before it schedules; a burst through the router arrives together); false: at the first of
    # them, the others waiting for the next step (every run before; experiments/sim_fidelity's turn-0 burst)
    batch_arrivals: bool = False
    router_overhead_s: float = 0.0008  # the router's time per request (experiments/bench_router: added p50)
    # with host_cores, over HTTP: a request's time outside the engines beyond the router's with every core busy with
    # steps, scaled by the cores' busy share at its send (framework/sim/cluster.py; the client's, router's and
    # worker's HTTP processes wait for a core); 0: none. experiments/sim_fidelity --outside load reads it
    outside_busy_s: float = 0.0
    # over HTTP: each request's time outside the engines drawn around its mean (the router's and outside_busy_s's)
    # from a gamma of this coefficient of variation, mean 1, seeded by outside_seed (framework/sim/cluster.py); 0: the
    # mean itself. This VM's real runs: 0.8-1.0 (p10 2 ms, p50 7, p90 20 at 16 in flight; experiments/sim_fidelity)
    outside_cv: float = 0.0
    outside_seed: int = 0
    network_latency_s: float = 0.00005  # one way, per hop (client -> router -> worker and back)
    fast_forward: bool = True         # advance runs of plain decode steps in one event (same results, faster)
    itl: bool = True                  # keep every token's time (requests.jsonl's itl_s); off: bounded memory at scale
    answers: SimAnswers = SimAnswers.printable   # answers' ids: printable ASCII, or the real engine's measured ones
    published: Any = None             # an experiment's published figures, printed beside the run's (framework/runs/sim.py)
    # cluster.roles: when a prefill half starts (framework/sim/pd.py). sglang: once its decode instance pre-allocated
    # its slots (SGLang's bootstrap queue); distserve: at once, its KV held until the decode side takes it (DistServe's
    # pull, as servelab's real path does)
    pd_order: str = "sglang"


@dataclass
class RootConfig:
    mode: Mode = Mode.bench
    seed: int = 0
    progress_interval_s: float = 30.0   # off a terminal, a progress line this often (framework/runs/progress.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)   # the GPU mode=sim prices steps on
    sim: SimConfig = field(default_factory=SimConfig)
    parallel: Any = None
    moe: Any = None
    router: Any = None
    workload: Any = None


_STORED_PLUGINS: tuple = ()   # the plugin Configs register_configs stored last


def register_configs() -> None:
    """Store every schema: the root, the framework's groups, and each registered plugin's Config (for `router`, the
    plugin's Config combined with the router service's settings: framework/serving/router/config.py). Once per set
    of plugins: storing is a third of a compose's time, and tests and scripts compose hundreds of times."""
    global _STORED_PLUGINS
    plugins = tuple((group, key, registry.get(key).Config) for group, registry in PLUGIN_GROUPS.items()
                    for key in registry.keys())
    if plugins == _STORED_PLUGINS:
        return
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="servelab_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    cs.store(group="hardware", name="hardware_schema", node=HardwareConfig)
    from framework.serving.router.config import router_schema
    for group, registry in PLUGIN_GROUPS.items():
        for key in registry.keys():
            node = registry.get(key).Config
            cs.store(group=group, name=f"{key}_schema", node=router_schema(node) if group == "router" else node)
    _STORED_PLUGINS = plugins


def to_objects(cfg) -> Any:
    """The composed DictConfig -> plain dataclass objects (plugins get their own Config instances)."""
    from omegaconf import OmegaConf
    return OmegaConf.to_object(cfg)


CONF_DIR = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "conf")


def group_overrides(overrides: list[str]) -> list[str]:
    """Overrides as users type them -> as Hydra takes them: a dotted key naming a nested config group chooses its
    option (`sim.cost=roofline` -> `sim/cost=roofline`, sweeps' `sim.cost=a,b` alike), while the group's fields keep
    their dotted keys (`sim.cost.path=...`). run.py (runs, multiruns, W&B sweep agents) and compose() pass here."""
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        name = key.lstrip("+~")
        group = name.replace(".", "/")
        if eq and group != name and group in PLUGIN_GROUPS:
            arg = f"{key[:len(key) - len(name)]}{group}={value}"
        out.append(arg)
    return out


def compose_dict(overrides: list[str]):
    """What `python run.py <overrides>` composes, as a DictConfig (for scripts and tests that skip run.py)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=group_overrides(overrides))


def compose(overrides: list[str]) -> RootConfig:
    """`compose_dict` as plain dataclass objects."""
    return to_objects(compose_dict(overrides))


MAX_CHECKED_POINTS = 12      # a multirun's points composed before any runs (0.2-1 s each); the others check themselves


def check_overrides(argv: list[str]) -> None:
    """Before Hydra runs: an option no group offers, a misspelt key, a wrong type or a key the run would ignore ends
    in one sentence (exit status 2) naming what is allowed, rather than Hydra's message or a refusal per point of a
    multirun. Other flags (--cfg, --info, ...) are left to Hydra."""
    import sys
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    overrides = [a for a in argv if "=" in a and (not a.lstrip("+~").startswith("hydra")   # compose_dict groups them
                                                  or a.lstrip("+~").startswith("hydra.searchpath="))]  # 3rd-party YAML
    message = command_line_problem(overrides, multirun)
    if message:
        print(f"config error: {message}", file=sys.stderr)
        sys.exit(2)


def command_line_problem(overrides: list[str], multirun: bool = False) -> str | None:
    """Why `python run.py [-m] <overrides>` cannot run, in one sentence, or None."""
    from framework.overrides import group_options, points, searchpaths, spread, unknown_choice
    register_configs()
    try:
        options = group_options(CONF_DIR, tuple(searchpaths(overrides)))
        message = unknown_choice(overrides, options, registered_plugins())
    except Exception as e:                      # noqa: BLE001 - an override Hydra cannot parse: its message, one line
        return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    if message:
        return message
    every = points(overrides) if multirun else [overrides]
    if every is None:                           # expanded by the sweeper, or a huge grid: each point checks itself
        return None
    runs = spread(every, MAX_CHECKED_POINTS)
    refused = {}
    with _composer() as compose_one:
        for point in runs:
            if (why := _compose_checked(compose_one, point)[1]) is not None:
                refused.setdefault(why, []).append(point)
    if not refused or not multirun:
        return next(iter(refused), None)
    why, where = next(iter(refused.items()))
    count = sum(len(p) for p in refused.values())
    share = (("every point" if count == len(runs) else f"{count} of {len(runs)} points") if runs is every else
             f"{count} of the {len(runs)} points checked (of {len(every)})")
    return f"{why} ({share} of the multirun, e.g. {' '.join(where[0]) or 'the defaults'}; none was run)"


def registered_plugins() -> dict[str, dict[str, str]]:
    """{group as users type it: {plugin key: the module that registered it}}."""
    return {g.replace("/", "."): {k: getattr(r.get(k), "__module__", "") for k in r.keys()}
            for g, r in PLUGIN_GROUPS.items()}


@contextmanager
def _composer():
    """compose(overrides) -> DictConfig, with Hydra initialised once for many compositions."""
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield lambda overrides: hydra_compose("config", overrides=group_overrides(overrides))


def _compose_checked(compose_one, overrides: list[str]):
    """(the composed DictConfig or None, why a run of `overrides` would be refused or None)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError
    from framework.core.errors import UserError
    composed = None
    try:
        composed = compose_one(overrides)
        refuse_ignored_keys(to_objects(composed), group_overrides(overrides))
        return composed, None
    except UserError as e:
        return composed, str(e)
    except Exception as e:                      # noqa: BLE001 - we only reword what we recognise
        err = e
        while err is not None and not isinstance(err, (ConfigKeyError, ConfigAttributeError, ValidationError)):
            err = err.__cause__ or err.__context__
        if err is None:
            return composed, " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or \
                type(e).__name__
        return composed, _explain(err)


def refuse_schema_choices(choices) -> None:
    """A run whose config groups chose a `<key>_schema` entry (a glob sweep, a W&B sweep's command line): refused, as
    the command line is (framework/overrides.py)."""
    from framework.core.errors import UserError
    from framework.overrides import SCHEMA_SUFFIX
    bad = [f"{group.replace('/', '.')}={value}" for group, value in (choices or {}).items()
           if not str(group).startswith("hydra") and str(value).endswith(SCHEMA_SUFFIX)]
    if bad:
        raise UserError(f"{', '.join(bad)}: a schema the YAML files build on, not a choice; `python run.py --help` "
                        f"lists the choices")


def _explain(err) -> str:
    import dataclasses
    key = getattr(err, "full_key", None) or "?"
    schema = getattr(err, "object_type", None)
    first_line = str(err).strip().splitlines()[0]
    if dataclasses.is_dataclass(schema) and "not in" in first_line:
        valid = ", ".join(f.name for f in dataclasses.fields(schema))
        parent = key.rsplit(".", 1)[0] if "." in key else "the top level"
        return f"unknown key {key!r}; valid keys of {parent} ({schema.__name__}): {valid}"
    return f"{key}: {first_line}"


# -- config honesty: a key this run ignores is refused at start, never dropped ---------------------------------------
CLUSTER_PROCESS_KEYS = ("cluster.worker_ports", "cluster.startup_timeout_s", "cluster.request_timeout_s",
                        "cluster.client_retries", "cluster.restart_workers", "cluster.max_restarts",
                        "cluster.restart_window_s", "cluster.restart_backoff_s")     # real processes and sockets only
RANK_KEYS = ("parallel.backend", "parallel.timeout_s", "parallel.master_port")     # real ranks only
HTTP_CLIENT_KEYS = ("workload.api", "workload.model", "workload.sample_interval_s")  # the HTTP load client's
LOCAL_INSTANCE_KEYS = ("model", "parallel", "moe", "engine", "cluster.instances", "cluster.worker_ports",
                       "cluster.kv_events", "cluster.kv_block_size")               # what local workers are built from
SIM_ROUTER_KEYS = ("router.maintain_interval_secs", "router.load_poll_interval_s",  # the service settings sim reads
                   "router.dp_aware",
                   "router.pd_decider", "router.pd_local_prefill_max_tokens", "router.pd_max_prefill_queue",
                   "router.pd_bytes_per_token")                                   # (P/D: framework/sim/pd.py)


def set_keys(overrides) -> list[tuple[str, str]]:
    """(dotted key, value) of each override that sets a config key (`sim/cost=x` -> `sim.cost`); Hydra's own and
    `experiment=` left out."""
    out = []
    for arg in overrides:
        key, _, value = str(arg).partition("=")
        key = key.lstrip("+~").replace("/", ".")
        if key and not key.startswith(("hydra", "experiment")):
            out.append((key, value))
    return out


def refuse_ignored_keys(cfg: RootConfig, overrides) -> None:
    """Refuse (UserError: one sentence, exit status 2) a run whose `overrides` (as Hydra took them: the command line,
    or a multirun point's) set a key this run's mode, drivers or plugins would ignore. run.py calls it for every run."""
    from framework.core.errors import UserError
    rules = ignored_key_rules(cfg)
    problems = []
    for key, value in set_keys(overrides):
        why = next((why for prefixes, why in rules
                    if any(key == p or key.startswith(p + ".") for p in prefixes)), None)
        if why is not None:
            problems.append(f"{key}={value} is ignored: {why}")
    if problems:
        raise UserError("; ".join(problems))


def ignored_key_rules(cfg: RootConfig) -> list[tuple[tuple[str, ...], str]]:
    """(key prefixes, why a run of `cfg` ignores them and what to do), the first that matches a key deciding."""
    rules = _mode_rules(cfg)
    if cfg.mode is Mode.verify:
        return rules + [(("router", "workload", "cluster"), "mode=verify checks one instance's logits against the "
                         "reference: it starts no router or workers and plays no workload; drop it")]
    if cfg.mode is Mode.serve:
        rules.append((("workload",), "mode=serve keeps the cluster up for clients and plays no workload; drop it, or "
                      "run mode=bench"))
        if not cfg.cluster.http:
            rules.append((("cluster.http",), "mode=serve always serves over HTTP; drop cluster.http=false"))
    elif cfg.cluster.url:
        return rules + [((*LOCAL_INSTANCE_KEYS, "router", *(f"cluster.{f.name}" for f in fields(ClusterConfig)
                                                             if f.name not in ("url", "request_timeout_s",
                                                                               "client_retries"))),
                         "cluster.url drives a server started elsewhere and starts nothing here; drop it, or drop "
                         "cluster.url")]
    elif not cfg.cluster.http:
        rules.append((("router", *(f"cluster.{f.name}" for f in fields(ClusterConfig) if f.name != "http"),
                       *HTTP_CLIENT_KEYS), "cluster.http=false plays the workload straight into one instance in this "
                      "process, with no router, workers or HTTP; drop it, or drop cluster.http=false"))
    if cfg.cluster.workers:
        rules.append((LOCAL_INSTANCE_KEYS, "cluster.workers fronts servers started elsewhere, so no local instance "
                      "starts; drop it, or drop cluster.workers"))
    return rules + _router_rules(cfg) + _workload_rules(cfg)


def _mode_rules(cfg: RootConfig) -> list[tuple[tuple[str, ...], str]]:
    """What only one mode reads, and what mode=sim, which makes no process or socket, does not read."""
    from framework.serving.router.config import SERVICE_FIELDS
    rules = []
    if cfg.mode is not Mode.verify:
        rules.append((("verify",), "only mode=verify reads it; add mode=verify or drop it"))
    if cfg.mode is not Mode.sim:
        return rules + [(("sim", "hardware"), "only mode=sim reads it (the simulator's cost model and the GPU it "
                         "prices); add mode=sim or drop it")]
    if not COST.get(cfg.sim.cost.name).reads_hardware:
        rules.append((("hardware",), f"sim.cost={cfg.sim.cost.name} prices the engine it measured, not a GPU; use "
                      f"sim.cost=roofline, or drop it"))
    service = tuple(f"router.{n}" for n in sorted(SERVICE_FIELDS) if f"router.{n}" not in SIM_ROUTER_KEYS)
    return rules + [((*CLUSTER_PROCESS_KEYS, *RANK_KEYS, *HTTP_CLIENT_KEYS, *service), "mode=sim simulates the "
                     "cluster in this process (no process, port, socket or retry; servelab's router core decides), "
                     "so it does not apply; drop it")]


def _router_rules(cfg: RootConfig) -> list[tuple[tuple[str, ...], str]]:
    """What the chosen policy says it ignores with this config, and under router.impl=sglang what SGLang's router's
    command line cannot carry."""
    from framework.cluster.peer_router import SERVICE_FLAGS
    from framework.serving.router.config import SERVICE_FIELDS, RouterImpl
    policy = ROUTING.get(cfg.router.name)
    rules = [((f"router.{key}",), why) for key, why in policy.ignored_keys(cfg.router).items()]
    if cfg.mode is Mode.sim or cfg.router.impl is not RouterImpl.sglang:
        return rules
    return rules + [
        (tuple(f"router.{n}" for n in sorted(SERVICE_FIELDS) if n not in SERVICE_FLAGS),
         "router.impl=sglang runs SGLang's router, which keeps its own default for it; drop it, or use "
         "router.impl=servelab"),
        (tuple(f"router.{n}" for n in policy.sglang_ignores),
         f"router.impl=sglang runs SGLang's router, which has no flag for it (router={cfg.router.name}'s "
         f"sglang_args); drop it, or use router.impl=servelab")]


def _workload_rules(cfg: RootConfig) -> list[tuple[tuple[str, ...], str]]:
    """What the chosen workload plugin says it ignores with this config."""
    ignored = WORKLOAD.get(cfg.workload.name).ignored_keys(cfg.workload)
    return [((f"workload.{key}",), why) for key, why in ignored.items()]


def print_help(argv: list[str]) -> None:
    """`python run.py --help [overrides]`: the config groups' options, then the config those overrides compose."""
    from omegaconf import OmegaConf
    from framework.overrides import group_options, help_text, searchpaths, unknown_choice
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    register_configs()
    options = group_options(CONF_DIR, tuple(searchpaths(overrides)))
    print(help_text(options))
    why = unknown_choice(overrides, options, registered_plugins())
    composed = None
    if why is None:
        with _composer() as compose_one:
            composed, why = _compose_checked(compose_one, [a for a in overrides
                                                           if not a.lstrip("+~").startswith("hydra")])
    if composed is not None:
        print("\nThe composed config:\n" + OmegaConf.to_yaml(composed, resolve=False))
    if why:
        print(f"(config error: {why})")
