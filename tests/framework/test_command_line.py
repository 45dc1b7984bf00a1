"""The command line before Hydra runs, as a user meets it: an option no group offers (a plugin that does not exist, a
schema that is no choice) and a multirun whose points would be refused end in one sentence naming what is allowed
and exit status 2, before any point runs; `--help` lists the choices without the schemas."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import PLUGIN_GROUPS, command_line_problem, print_help, refuse_schema_choices
from framework.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def yaml_choices(group: str) -> list[str]:
    """What conf/<group>/ offers: its YAML files (the oracle the message is checked against)."""
    return sorted(p.stem for p in (ROOT / "conf" / group.replace(".", "/")).glob("*.yaml"))


@pytest.mark.parametrize("group", [g.replace("/", ".") for g in PLUGIN_GROUPS] + ["model", "hardware", "experiment"])
def test_an_unknown_option_names_the_group_and_its_choices(group):
    message = command_line_problem([f"{group}=nope"])
    assert message == f"{group}=nope does not exist; the choices of {group} are: {', '.join(yaml_choices(group))}"
    assert "_schema" not in message and "search path" not in message


def test_a_schema_is_no_choice():
    message = command_line_problem(["router=cache_aware_schema"])
    assert message.startswith("router=cache_aware_schema is the schema its YAML files build on, not a choice; "
                              "the choices of router are: cache_aware, ")
    glob = command_line_problem(["router=glob(*)"], multirun=True)          # Hydra's glob would run the schemas
    assert glob.startswith("router=glob(*) would also run the schemas cache_aware_schema")
    assert command_line_problem(["router=glob(*,exclude=*_schema)", "cluster.http=true"], multirun=True) is None


def test_a_run_that_composed_a_schema_is_refused():
    """What run.py checks of every run Hydra composed (a W&B sweep's command line, a sweeper's own choices)."""
    with pytest.raises(UserError, match=r"^router=cache_aware_schema: a schema the YAML files build on, not a choice"):
        refuse_schema_choices({"router": "cache_aware_schema", "moe": "reference", "hydra/launcher": "basic"})
    refuse_schema_choices({"router": "cache_aware", "sim/cost": "roofline", "experiment": None})


def test_a_multirun_refused_in_every_point_is_refused_once():
    """Issue 24 item 1: router= with cluster.http=false was two identical points; now one sentence, nothing run."""
    message = command_line_problem(["router=round_robin,cache_aware", "cluster.http=false"], multirun=True)
    assert message.startswith("router=round_robin is ignored: cluster.http=false plays the workload straight into one "
                              "instance")
    assert message.endswith("(every point of the multirun, e.g. router=round_robin cluster.http=false; none was run)")
    some = command_line_problem(["mode=bench,sim", "router.port=0"], multirun=True)
    assert some.startswith("router.port=0 is ignored: mode=sim") and "(1 of 2 points of the multirun" in some


def test_help_lists_choices_without_schemas(capsys):
    print_help(["router=round_robin"])
    out = capsys.readouterr().out
    assert "_schema" not in out
    assert f"router      {', '.join(yaml_choices('router'))}" in out
    assert "name: round_robin" in out                       # the config the overrides compose


@pytest.mark.long
def test_run_py_refuses_an_unknown_plugin_in_a_multirun_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "run.py", "-m", "router=round_robin,nope", f"hydra.sweep.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"config error: router=nope does not exist; the choices of router are: "
                                     f"{', '.join(yaml_choices('router'))}"]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())      # no point ran
