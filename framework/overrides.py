"""run.py's command line before Hydra starts: which option each config group offers (its YAML files; never the
`<key>_schema` entries that framework/config.py stores for those files to build on), an override choosing an option
that does not exist, and a multirun's points, so that a setting wrong in every point is refused once, before any
point runs."""
from __future__ import annotations

import itertools
from functools import lru_cache

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType

SCHEMA_SUFFIX = "_schema"       # framework/config.py stores each schema as `<group>/<key>_schema`
LISTED_SWEEPS = (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP)


@lru_cache(maxsize=None)
def _parser() -> OverridesParser:
    return OverridesParser.create()


def parse(overrides: list[str]) -> list[Override]:
    return _parser().parse_overrides(list(overrides))


def searchpaths(overrides: list[str]) -> list[str]:
    """The extra config directories a `hydra.searchpath=[...]` override adds (third-party plugins' YAML)."""
    for o in parse([a for a in overrides if a.lstrip("+~").startswith("hydra.searchpath=")]):
        value = o.value()
        return [value] if isinstance(value, str) else list(value or [])
    return []


def group_options(conf_dir: str, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """{group as users type it (`sim.cost`): the options its YAML files offer} for every config group of the app
    (Hydra's own `hydra/...` groups left out). The schemas must be stored already (register_configs)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType
    search = create_config_search_path(conf_dir)
    for path in extra:
        search.append("command-line", path)
    repo = ConfigRepository(config_search_path=search)     # Hydra's loader would deep-copy it for every group

    def walk(parent: str) -> dict[str, list[str]]:
        out = {}
        for name in repo.get_group_options(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            if group == "hydra":
                continue
            options = [o for o in repo.get_group_options(group, ObjectType.CONFIG) if not o.endswith(SCHEMA_SUFFIX)]
            if options:
                out[group.replace("/", ".")] = options
            out.update(walk(group))
        return out
    return walk("")


def chosen(o: Override) -> list[str] | None:
    """The options an override of a config group chooses (every value of a listed sweep), or None where it chooses
    none or Hydra expands it (interval, glob)."""
    if o.is_delete() or o.package is not None:
        return None
    if not o.is_sweep_override():
        return [o.get_value_element_as_str()]
    if o.value_type in LISTED_SWEEPS:
        return list(o.sweep_string_iterator())
    return None


def unknown_choice(overrides: list[str], options: dict[str, list[str]],
                   registered: dict[str, dict[str, str]]) -> str | None:
    """One sentence about the first override choosing an option its group does not offer, or None. `registered`:
    {group: {plugin key in the registry: its module}} (a key without a YAML file gets told where the file goes)."""
    for o in parse(overrides):
        group = o.key_or_group.replace("/", ".")
        if group not in options:
            continue
        offered = options[group]
        if o.value_type is ValueType.GLOB_CHOICE_SWEEP:
            schemas = [f"{k}{SCHEMA_SUFFIX}" for k in [*registered.get(group, {}), group.split(".")[-1]]]
            hidden = o.value().filter(offered + schemas)       # as Hydra's glob would expand it
            schemas = [h for h in hidden if h not in offered]
            if schemas:
                what = "the schema" if len(schemas) == 1 else "the schemas"
                return (f"{o.input_line} would also run {what} {', '.join(schemas)}, which the YAML files build on; "
                        f"choose from: {', '.join(offered)} (e.g. {group}=glob(*,exclude=*{SCHEMA_SUFFIX}))")
            continue
        for value in chosen(o) or []:
            if value in offered or value == "null":        # null: the group left out (`experiment=null`)
                continue
            if value.endswith(SCHEMA_SUFFIX):
                why = "is the schema its YAML files build on, not a choice"
            elif value in registered.get(group, {}):
                package = registered[group][value].split(".")[0]
                why = (f"is registered but has no YAML file: add conf/{group.replace('.', '/')}/{value}.yaml"
                       if package == "plugins" else f"is registered by {package} but no YAML file offers it: add "
                       f"hydra.searchpath=[pkg://{package}.conf] to the command line") + " (docs/extension.md)"
            else:
                why = "does not exist"
            return f"{group}={value} {why}; the choices of {group} are: {', '.join(offered)}"
    return None


def points(overrides: list[str], limit: int = 10_000) -> list[list[str]] | None:
    """A multirun's points (each its overrides, as Hydra's basic sweeper makes them), or None when there are more
    than `limit` or a sweep is one only its sweeper expands (interval, glob, tags)."""
    axes = []
    for o in parse(overrides):
        if not o.is_sweep_override():
            axes.append([o.input_line])
        elif o.value_type in LISTED_SWEEPS:
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            return None
    total = 1
    for axis in axes:
        total *= len(axis)
    if total > limit:
        return None
    return [list(p) for p in itertools.product(*axes)]


def spread(items: list, n: int) -> list:
    """At most n of `items`, evenly spaced, the first and last among them."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:1]


def help_text(options: dict[str, list[str]]) -> str:
    """`python run.py --help`: the groups and their options."""
    width = max(len(g) for g in options)
    groups = "\n".join(f"  {g:<{width}}  {', '.join(o)}" for g, o in sorted(options.items()))
    return f"""servelab: python run.py [group=option ...] [key=value ...]   (README.md)
       python run.py -m group=a,b key=1,2             a multirun: every combination, one run each

Config groups (group=option; sim.cost=... as typed):
{groups}

Keys: any key of the composed config (engine.kv_budget_mb=8, router.cache_threshold=0.3); a misspelt one is refused
with the valid keys named. `python run.py --cfg job [overrides]` prints the composed config, `--hydra-help` Hydra's
own flags. Each run writes config.json (what ran), results.json, requests.jsonl and run.log into its folder
(outputs/<date>/<time>/, multirun/... for -m)."""
