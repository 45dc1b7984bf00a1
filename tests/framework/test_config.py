"""Every config option composes and builds; typos and wrong types fail at start with a clear message."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from framework.config import PLUGIN_GROUPS, check_overrides, register_configs, to_objects

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
register_configs()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.long   # ~10 s of Hydra composes: every option of every group
@pytest.mark.parametrize("group", ["model", "parallel", "moe", "router", "workload", "cluster", "logger"])
def test_every_option_composes_and_builds(group):
    for option in _options(group):
        cfg = to_objects(_compose([f"{group}={option}"]))
        node = getattr(cfg, group)
        if group in PLUGIN_GROUPS:
            plugin = PLUGIN_GROUPS[group].get(node.name)
            assert isinstance(node, plugin.Config), (group, option)


def _needs_missing_hydra_plugin(option: str) -> bool:
    """An experiment that picks a Hydra sweeper/launcher ('.[studies]') composes only where that plugin is installed."""
    text = (CONF / "experiment" / f"{option}.yaml").read_text()
    return ("hydra/sweeper" in text or "hydra/launcher" in text) and not _hydra_plugins_installed()


def _hydra_plugins_installed() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("option", _options("experiment"))
def test_experiments_compose(option):
    if _needs_missing_hydra_plugin(option):
        pytest.skip(f"experiment={option} needs a Hydra plugin from '.[studies]'")
    to_objects(_compose([f"experiment={option}"]))


def _explain(capsys, overrides):
    with pytest.raises(SystemExit) as e:
        check_overrides(overrides)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_misspelt_key_names_valid_keys(capsys):
    err = _explain(capsys, ["engine.kv_budgt_mb=3"])
    assert "unknown key 'engine.kv_budgt_mb'" in err and "kv_budget_mb" in err and "chunked_prefill_tokens" in err


def test_misspelt_plugin_key_names_plugin_schema_keys(capsys):
    err = _explain(capsys, ["workload.num_conversation=3"])
    assert "num_conversations" in err


def test_wrong_type_and_unknown_option(capsys):
    assert "could not be converted to Float" in _explain(capsys, ["engine.kv_budget_mb=lots"])
    err = _explain(capsys, ["moe=nope"])
    choices = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "moe").glob("*.yaml")))   # no moe/*_schema
    assert err == f"config error: moe=nope does not exist; the choices of moe are: {choices}\n"
    assert "expected one of [bench, verify, serve, sim]" in _explain(capsys, ["mode=fast"])


def test_good_overrides_pass():
    check_overrides(["engine.kv_budget_mb=3", "workload.num_requests=4"])


@pytest.mark.parametrize("override, message", [   # ~4 s of imports each: one in the quick run, two in the long one
    ("engine.kv_budget_mb=-1", "engine.kv_budget_mb must be > 0"),
    pytest.param("parallel.name=nope", "unknown parallelism plugin 'nope'; known:", marks=pytest.mark.long),
    pytest.param("model.n_group=3", "n_routed_experts=8 is not divisible by n_group=3", marks=pytest.mark.long)])
def test_bad_values_fail_with_one_sentence(tmp_path, override, message):
    r = subprocess.run([sys.executable, "run.py", override, "logger.mode=disabled", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (override, r.stderr[-2000:])
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
