"""sim.cost=calibrated says, once per profile, when the profile was stamped on another CPU than this host's."""
import json
import logging

from framework.core.host_probe import cpu_model
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.config import compose
from framework.runs.sim import cost_instance
from plugins.cost.calibrated import DEFAULT_PATH


def _profile(tmp_path, name: str, model: str):
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    data["host_probe"] = {**data["host_probe"], "cpu_model": model}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _build(path: str):
    shape = cost_instance(compose(["logger.mode=disabled"]))
    return COST.build("calibrated", COST.get("calibrated").Config(path=path), shape)


def test_a_profile_of_another_cpu_is_named_once_with_the_profiles_of_this_one(tmp_path, caplog):
    other = _profile(tmp_path, "other.json", "Some Other CPU 9000")
    with caplog.at_level(logging.INFO, logger="plugins.cost.calibrated"):
        _build(other)
        _build(other)
    notes = [r.getMessage() for r in caplog.records if other in r.getMessage()]
    assert len(notes) == 1
    assert "'Some Other CPU 9000'" in notes[0] and repr(cpu_model()) in notes[0]
    committed = [str(p.relative_to(REPO_ROOT)) for p in sorted((REPO_ROOT / "data" / "calibration").glob("*.json"))
                 if json.loads(p.read_text()).get("host_probe", {}).get("cpu_model") == cpu_model()]
    for name in committed:   # those stamped on this host's CPU are offered; none: how to profile it
        assert name in notes[0]
    if not committed:
        assert "experiments/calibrate/run.py" in notes[0]


def test_a_profile_of_this_cpu_says_nothing(tmp_path, caplog):
    mine = _profile(tmp_path, "mine.json", cpu_model())
    with caplog.at_level(logging.INFO, logger="plugins.cost.calibrated"):
        _build(mine)
    assert not [r for r in caplog.records if mine in r.getMessage()]
