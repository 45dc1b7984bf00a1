"""framework.core.paths.load_script: the checkout's scripts as modules by their paths. experiments/ holds many run.py;
a bare `import run` takes whichever folder's came first in the process (round L's first judged attempt stopped so:
experiments/sim_fidelity asked for dp_attn_vs_tp's `bench` and got calibrate's run.py, which the engine probe had
imported)."""
import sys

import pytest

from framework.core.paths import load_script
from script_loader import load_script as load_test_script


def test_two_run_scripts_load_as_two_modules_once_each():
    calibrate = load_script("experiments/calibrate/run.py", fresh=True)
    scheme = load_script("experiments/dp_attn_vs_tp/run.py", fresh=True)
    assert (calibrate.__name__, scheme.__name__) == ("calibrate_run", "dp_attn_vs_tp_run")
    assert hasattr(scheme, "bench") and not hasattr(calibrate, "bench") and hasattr(calibrate, "_serve")
    assert load_script("experiments/dp_attn_vs_tp/run.py") is scheme                 # once per process
    assert load_script("experiments/dp_attn_vs_tp/run.py", fresh=True) is not scheme  # unless asked afresh


def test_a_script_that_fails_to_load_leaves_the_one_before(tmp_path):
    script = tmp_path / "study" / "tool.py"
    script.parent.mkdir()
    script.write_text("VALUE = 1\n")
    good = load_script(script, fresh=True)
    script.write_text("raise RuntimeError('half-run')\n")
    with pytest.raises(RuntimeError, match="half-run"):
        load_script(script, fresh=True)
    assert sys.modules["study_tool"] is good and load_script(script).VALUE == 1
    del sys.modules["study_tool"]


class _Sentinel(Exception):
    pass


def test_sim_fidelity_takes_the_tp_dp_bench_by_its_path_whatever_a_bare_run_is(monkeypatch, tmp_path):
    fidelity = load_test_script("experiments/sim_fidelity/run.py")
    monkeypatch.setitem(sys.modules, "run", load_script("experiments/calibrate/run.py"))   # as the engine probe left it
    asked = []

    class Scheme:
        @staticmethod
        def bench(overrides, out):
            raise _Sentinel(out)

    monkeypatch.setattr(fidelity, "load_script", lambda path: asked.append(path) or Scheme)
    with pytest.raises(_Sentinel):
        fidelity.scheme_cases(True, tmp_path, [])
    assert asked == ["experiments/dp_attn_vs_tp/run.py"]
