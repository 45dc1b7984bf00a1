"""The workload contract, over every registered workload key (built-ins and any installed through the entry-point
group): `workload=<key>` composes to the plugin's own Config, named by its key; what it declares (`sized_by`,
`ignored_keys`) names its Config's fields; its sessions are well formed and the same for the same seed. A plugin
module without its YAML file is told where the file goes (docs/extension.md)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from framework.config import compose
from framework.contracts.workload import Workload, WorkloadConfig
from framework.core.registry import WORKLOAD
from framework.overrides import unknown_choice

ROOT = Path(__file__).resolve().parents[2]
KEYS = [pytest.param(k, marks=pytest.mark.long) if k == "trace" else k      # trace reads the whole Mooncake trace
        for k in sorted(WORKLOAD.keys())]


@pytest.mark.parametrize("key", KEYS)
def test_workload_plugin_keeps_the_contract(key):
    plugin = WORKLOAD.get(key)
    assert issubclass(plugin, Workload) and issubclass(plugin.Config, WorkloadConfig)
    if plugin.__module__ == f"plugins.workload.{key}":                   # a built-in: its YAML is in conf/
        assert (ROOT / "conf" / "workload" / f"{key}.yaml").is_file()
    cfg = compose([f"workload={key}"]).workload
    assert type(cfg) is plugin.Config and cfg.name == key
    fields = {f.name for f in dataclasses.fields(plugin.Config)}
    assert set(plugin.sized_by) <= fields, plugin.sized_by
    for rate in (0.0, 2.0):
        ignored = plugin.ignored_keys(dataclasses.replace(cfg, request_rate=rate))
        assert set(ignored) <= fields and all(isinstance(why, str) and why for why in ignored.values()), ignored

    small = dataclasses.replace(cfg, num_requests=3, request_rate=2.0)
    sessions = WORKLOAD.build(key, small, 0).sessions()
    turns = [t for s in sessions for t in s.turns]
    assert 0 < len(turns) <= 3
    assert all(t.max_new_tokens >= 1 and isinstance(t.text, str) for t in turns)
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    again = WORKLOAD.build(key, small, 0).sessions()                      # the seed decides everything
    assert [(s.prefix, [t.text for t in s.turns], s.arrival_s) for s in again] == \
        [(s.prefix, [t.text for t in s.turns], s.arrival_s) for s in sessions]


def test_a_workload_module_without_its_yaml_is_told_where_it_goes():
    options = {"workload": ["multi_turn", "random"]}
    registered = {"workload": {"mine": "plugins.workload.mine", "theirs": "their_package.workload",
                               "multi_turn": "plugins.workload.multi_turn", "random": "plugins.workload.random"}}
    assert unknown_choice(["workload=mine"], options, registered) == (
        "workload=mine is registered but has no YAML file: add conf/workload/mine.yaml (docs/extension.md); the "
        "choices of workload are: multi_turn, random")
    assert unknown_choice(["workload=theirs"], options, registered) == (      # a plugin of another package
        "workload=theirs is registered by their_package but no YAML file offers it: add "
        "hydra.searchpath=[pkg://their_package.conf] to the command line (docs/extension.md); the choices of "
        "workload are: multi_turn, random")
