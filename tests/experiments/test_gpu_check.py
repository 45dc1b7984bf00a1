"""experiments/gpu_check/run.py, tested where no GPU is: it runs nothing without one; --cpu-smoke runs every part's
code path at tiny size; the GPU plan fits its 8 minutes and names files, flags and config keys that exist; the
kernels part's efficiency file is written only from a GPU run."""
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments/gpu_check/run.py"
gpu_check = load_script(SCRIPT)
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
sys.path.insert(0, str(ROOT))
from experiments.gpu_check import kernel_efficiency, kernels_bench  # noqa: E402


@pytest.mark.long
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: no CUDA device visible") and proc.stdout.count("\n") == 1
    assert not out.exists() and not out.with_suffix(".log").exists()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --cpu-smoke run for the tests that read it: (the process, its results JSON's path)."""
    out = tmp_path_factory.mktemp("smoke") / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    return proc, out


@pytest.mark.long
def test_cpu_smoke_runs_every_part(smoke):
    proc, out = smoke
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
    kernels = parts["kernels"]["records"]          # every row kind at toy size, each beside the roofline's time
    assert [r["kind"] for r in kernels] == [r["kind"] for r in kernels_bench.plan(kernels_bench.TINY)]
    measured = [r for r in kernels if "time_s" in r]
    assert {r["kind"] for r in measured} == {"mla_decode", "mla_extend", "fused_moe"}
    assert all(r["time_s"] > 0 and r["flops"] > 0 and r["bytes"] > 0 and r["predicted_s"] > 0 for r in measured)
    assert all(r["measured_over_predicted"] == r["time_s"] / r["predicted_s"] for r in measured)
    assert [r["skipped"] for r in kernels if r.get("dtype") == "fp8"] == [kernels_bench.fp8_unsupported(
        torch.device("cpu"))]   # the interpreter has no fp8 dot: recorded, not measured
    assert re.search(r"^mla_decode H=20 B=2 ctx=24\s+[0-9.]+", proc.stdout, re.M)


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


def test_the_kernels_plan_measures_what_the_cost_model_needs():
    """SGLang v0.4's shapes: decode at batch 64..1,024 with 16 heads (TP 8) and 128 (DP attention), extend for
    512-token prompts, the fused MoE at DeepSeek-V2's and V3's per-GPU expert shapes in bf16 and fp8."""
    rows = kernels_bench.plan(kernels_bench.FULL)
    decode = {(r["batch"], r["heads"]) for r in rows if r["kind"] == "mla_decode"}
    assert decode == {(b, h) for b in (64, 128, 256, 512, 1024) for h in (16, 128)}
    assert {(r["heads"], r["extend_len"]) for r in rows if r["kind"] == "mla_extend"} == {(16, 512), (128, 512)}
    moe = {(r["shape"], r["dtype"]) for r in rows if r["kind"] == "fused_moe"}
    assert moe == {(s, d) for s in ("v2", "v3") for d in ("bf16", "fp8")}
    shapes = kernels_bench.FULL["moe_shapes"]
    assert [(s["experts"], 2 * s["inter"], s["hidden"]) for s in shapes.values()] == [(160, 384, 5120),
                                                                                     (256, 512, 7168)]
    plan = {p.name: p for p in gpu_check.parts(gpu=True, write_configs=True)}
    argv = plan["kernels"].argv(Path("/part"))
    assert float(argv[argv.index("--budget-s") + 1]) + 10 <= plan["kernels"].timeout_s


def test_predictions_use_the_hardware_spec_the_simulator_uses():
    from framework.config import compose
    assert kernel_efficiency.load_hardware("h200") == compose(["hardware=h200"]).hardware


@pytest.mark.long
def test_efficiency_file_only_from_a_gpu_run(smoke, tmp_path):
    """The smoke's figures are refused (exit 2, nothing written); the same figures labelled as a GPU run become the
    data file, every measured row carried with its prediction, the versions and the caveat."""
    _, out = smoke
    script = ROOT / "experiments/gpu_check/kernel_efficiency.py"
    refused = subprocess.run([sys.executable, str(script), str(out), "--out-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not a GPU run" in refused.stdout and not list(tmp_path.iterdir())
    results = json.loads(out.read_text())
    figures = results["parts"]["kernels"]["figures"]
    results["meta"]["cpu_smoke"], figures["meta"]["tiny"], figures["meta"]["device"] = False, False, "NVIDIA H200"
    labelled = tmp_path / "gpu.json"
    labelled.write_text(json.dumps(results))
    proc = subprocess.run([sys.executable, str(script), str(labelled), "--out-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "kernel_efficiency_h200.json").read_text())
    measured = [r for r in figures["records"] if "time_s" in r]
    assert [r["time_s"] for r in written["rows"]] == [r["time_s"] for r in measured]
    assert all(r["measured_over_predicted"] > 0 for r in written["rows"])
    assert written["gpu"] == "NVIDIA H200" and written["triton"] == figures["meta"]["triton"]
    assert written["torch"] == figures["meta"]["torch"] and "2024 H100" in written["caveat"]
    assert written["skipped_rows"] == len(figures["records"]) - len(measured)
