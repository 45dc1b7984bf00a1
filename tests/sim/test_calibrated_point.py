"""sim.cost.point: the calibrated profile's fastest repeat of each point (the default) or its median; the real
engine's and the simulator's step CPU by kind (what sim_fidelity's work audit compares)."""
import json
import statistics

import pytest

from framework.config import compose
from framework.contracts.cost import BatchShape, Step
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.runs.sim import cost_instance, simulate
from plugins.cost.calibrated import DEFAULT_PATH
from script_loader import load_script


def _write(tmp_path, median: bool):
    """The committed profile, with each point's median made 1.5x its fastest (or dropped)."""
    data = json.loads((REPO_ROOT / DEFAULT_PATH).read_text())
    for prof in data["profiles"].values():
        for kind in ("prefill", "decode"):
            prof[kind].pop("seconds_median", None)
            if median:
                prof[kind]["seconds_median"] = [[1.5 * s for s in row] for row in prof[kind]["seconds"]]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    return path


def _cost(path, **kw):
    cfg = COST.get("calibrated").Config(path=str(path), between="grid", **kw)
    return COST.build("calibrated", cfg, cost_instance(compose(["logger.mode=disabled"])))


def test_median_prices_each_point_at_its_median_and_fastest_is_the_default(tmp_path):
    path = _write(tmp_path, median=True)
    fastest, median = _cost(path), _cost(path, point="median")
    pre = json.loads(path.read_text())["profiles"]["singlex1/reference"]["prefill"]
    n, p = pre["new"][2], pre["prefix"][1]
    step = Step(batches=(BatchShape("extend", (n,), (p,)),))
    assert fastest.step_time(step) == pytest.approx(pre["seconds"][2][1])
    assert median.step_time(step) == pytest.approx(1.5 * pre["seconds"][2][1])
    assert COST.get("calibrated").Config().point == "fastest"


def test_median_of_a_profile_without_medians_says_how_to_get_them(tmp_path):
    path = _write(tmp_path, median=False)
    with pytest.raises(ValueError, match=r"point=median.*re-profile.*experiments/calibrate/run.py"):
        _cost(path, point="median")
    with pytest.raises(ValueError, match=r"point='slowest'.*\('fastest', 'median'\)"):
        _cost(path, point="slowest")


def test_calibration_keeps_the_fastest_and_the_median_repeat():
    _points = load_script("experiments/calibrate/run.py")._points
    repeats = [[[3.0, 1.0, 2.0], [5.0, 4.0, 9.0]]]
    assert _points(repeats) == {"seconds": [[1.0, 4.0]], "seconds_median": [[2.0, statistics.median([5, 4, 9])]]}


@pytest.mark.parametrize("output_len", [1, 6])
def test_the_simulator_reports_its_priced_seconds_as_step_cpu_by_kind(monkeypatch, output_len):
    """Each step's price lands under the key the real engine counts its thread's CPU under: a step whose batch
    extends, or the rest; together, every priced second. One output token: prefills only."""
    from plugins.cost.calibrated import CalibratedCost
    priced = []
    step_time, decode_times = CalibratedCost.step_time, CalibratedCost.decode_times
    monkeypatch.setattr(CalibratedCost, "step_time", lambda self, step: priced.append(step_time(self, step))
                        or priced[-1])
    monkeypatch.setattr(CalibratedCost, "decode_times", lambda self, *a, **k: priced.extend(
        times := decode_times(self, *a, **k)) or times)
    cfg = compose(["mode=sim", "sim.cost=calibrated", "workload.num_requests=12", f"workload.output_len={output_len}",
                   "logger.mode=disabled"])
    results, _ = simulate(cfg)
    assert results["extend_cpu_s"] > 0
    assert (results["decode_cpu_s"] > 0) == (output_len > 1)
    assert results["extend_cpu_s"] + results["decode_cpu_s"] == pytest.approx(sum(priced))


def test_the_engine_counts_its_thread_cpu_in_steps_by_kind():
    import time
    from framework.dist.group import Group
    from framework.engine.config import EngineConfig
    from framework.engine.engine import Engine
    from framework.engine.request import Req, SamplingParams
    from framework.model.config import ModelConfig
    from framework.contracts.parallel import Parallelism, ParallelConfig
    from plugins.moe.reference import ReferenceConfig
    engine = Engine(ModelConfig(), EngineConfig(), Parallelism(ParallelConfig(), Group()), ReferenceConfig(), seed=0)
    c0 = time.thread_time()
    engine.add(Req(list(range(40, 104)), SamplingParams(max_new_tokens=5, ignore_eos=True)))
    while engine.step() is not None:
        pass
    spent = time.thread_time() - c0
    t = engine.timing
    assert t["extend_cpu_s"] > 0 and t["decode_cpu_s"] > 0       # one prefill, then four decode steps
    assert t["extend_cpu_s"] + t["decode_cpu_s"] <= spent + 1e-3
    assert engine.server_info()["extend_cpu_s"] == t["extend_cpu_s"]
