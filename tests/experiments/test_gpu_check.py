"""experiments/gpu_check/run.py, tested where no GPU is: it runs nothing without one; --cpu-smoke runs every part's
code path at tiny size; the GPU plan fits its 8 minutes and names files, flags and config keys that exist."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments/gpu_check/run.py"
spec = importlib.util.spec_from_file_location("gpu_check_run", SCRIPT)
gpu_check = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # (its dataclass looks itself up)
spec.loader.exec_module(gpu_check)
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: no CUDA device visible") and proc.stdout.count("\n") == 1
    assert not out.exists() and not out.with_suffix(".log").exists()


def test_cpu_smoke_runs_every_part(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    results = json.loads(out.read_text())
    assert proc.returncode == 0, {name: p["tail"] for name, p in results["parts"].items() if p["status"] != "ok"}
    names = [p.name for p in gpu_check.parts(gpu=True, write_configs=True)]
    assert list(results["parts"]) == names   # the smoke runs the GPU plan's parts, in its order
    parts = {name: p["figures"] for name, p in results["parts"].items()}
    assert parts["gpu_tests"]["tests"] > 0 and parts["gpu_tests"]["failed_tests"] == []
    for name in ("verify_tp_fp32", "verify_dp_attn_fp32", "verify_tp_bf16", "verify_dp_attn_bf16"):
        assert parts[name]["verify_passed"] is True and parts[name]["verify_max_abs_err"] >= 0, name
    assert parts["verify_tp_bf16"]["verify_atol"] == gpu_check.BF16_VERIFY_ATOL
    rows = parts["decode_step"]["rows"]           # eager and graphs on (a CPU has none: every step eager, counted)
    assert [(row["batch"], row["cuda_graph"]) for row in rows] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(row["graph_replayed_steps"] == 0 and row["graph_eager_steps"] > 0 for row in rows)
    for name in ("tune_tiny", "tune_v2lite"):
        assert sorted(parts[name]["table"]) == ["1", "3"] and parts[name]["tried"] >= 1
    kernel = [r for r in parts["bench_moe"]["records"] if "weight_gbs" in r]
    assert {r["batch_tokens"] for r in kernel} == {1, 4}
    assert all(p["headline"] and p["wall_s"] > 0 for p in results["parts"].values())
    assert results["meta"]["cpu_smoke"] is True and results["meta"]["setup"] == {"missing": []}
    assert "===== bench_moe: ok" in out.with_suffix(".log").read_text()
    assert re.search(r"^bench_moe\s+ok", proc.stdout, re.M)
    assert re.search(r"^\s+1\s+[0-9.]+\s+\d+", proc.stdout.split("fused kernel alone (expert_gemms)")[1], re.M)


def test_gpu_plan_fits_the_budget_and_names_what_exists():
    plan = gpu_check.parts(gpu=True, write_configs=True)
    assert sum(p.timeout_s for p in plan) <= gpu_check.TOTAL_BUDGET_S <= 8 * 60
    argv = {p.name: p.argv(Path("/part")) for p in plan}
    for path in gpu_check.GPU_TEST_PATHS:
        assert (ROOT / path).exists(), path
    for name, args in argv.items():
        scripts = [a for a in args if a.endswith(".py")]
        assert all((ROOT / a).is_file() for a in scripts), (name, scripts)
    from framework.config import compose
    for name in (n for n in argv if n.startswith("verify_")):
        overrides = [a for a in argv[name] if "=" in a and not a.startswith("hydra.")]
        cfg = compose(overrides)   # every key exists and has the right type
        assert (cfg.engine.device, cfg.moe.kernel, cfg.parallel.size) == ("cuda", "triton", 1)
    assert "--out-dir" not in argv["tune_v2lite"]   # --write-configs: into kernels/configs/, before bench_moe
    assert "--out-dir" in gpu_check.parts(gpu=True, write_configs=False)[-2].argv(Path("/part"))
    for name in ("tune_tiny", "tune_v2lite"):
        search_s = float(argv[name][argv[name].index("--budget-s") + 1])
        assert search_s + 10 <= next(p.timeout_s for p in plan if p.name == name)
    assert list(argv).index("bench_moe") > list(argv).index("tune_v2lite")
    assert "1" == argv["bench_moe"][argv["bench_moe"].index("--v2lite-scale") + 1]


def test_every_gpu_test_is_on_the_scripts_paths():
    """The script runs GPU_TEST_PATHS only (the device image lacks packages other tests import), so a GPU test
    anywhere else would never run there."""
    marked = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)", re.M)
    found = [path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
             if marked.search(path.read_text())]
    assert {"tests/gpu/test_fused_moe_cuda.py", "tests/dist/test_dist_nccl.py"} <= set(found)
    for rel in found:
        assert any(rel == p or rel.startswith(p + "/") for p in gpu_check.GPU_TEST_PATHS), rel


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel holding module `name`."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}.py", "ANSWER = 42\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_missing_packages_are_installed_from_carried_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("gpu_check_probe",))
    assert "problem" in gpu_check.ensure_packages(tmp_path / "none", tmp_path / "site")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe")
    setup = gpu_check.ensure_packages(wheels, tmp_path / "site")
    assert setup["pip_rc"] == 0 and setup["missing"] == ["gpu_check_probe"], setup
    probe = subprocess.run([sys.executable, "-c", "import gpu_check_probe; print(gpu_check_probe.ANSWER)"],
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert probe.stdout.strip() == "42", probe.stderr
