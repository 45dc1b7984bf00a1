"""The one prepared GPU check: every GPU-only part of servelab in one command, under 8 minutes on one H200.

    python experiments/gpu_check/run.py [--out results.json] [--write-configs] [--wheels .whl]
    python experiments/gpu_check/run.py --cpu-smoke      # every part's code path at tiny size on the CPU (CI)
    python experiments/gpu_check/run.py --apply-tuned results.json    # its tuned launch configs -> kernels/configs/

Parts, in order (each a subprocess with its own timeout, so one failure or hang loses nothing else; the JSON is
rewritten after each part, so even a killed run keeps what finished):
  gpu_tests      the GPU tests: compiled kernel vs the oracle (fp32/fp16/bf16, tiny and V2-Lite shapes), CUDA-graph
                 capture and replay, no host sync on the MoE path, CUDA-graph decode vs eager (same tokens, logits
                 within 1e-5 in fp32, 0.5 in bf16), NCCL; plus tests/kernels compiled
  verify_*       mode=verify on CUDA, parallel=tp and dp_attn, size 1, moe=triton_fused (the compiled kernel), fp32
                 (atol 1e-4) and bf16 (BF16_VERIFY_ATOL)
  decode_step    decode step time at batch 1/8/32/64/256 (moe=triton_fused), eager and replaying CUDA graphs
                 (engine.cuda_graph_max_bs=256 so that batch 256 has a graph too; SGLang's default 160 would run it
                 eagerly); the verify parts run with graphs on (the engine's default), against the reference
  kernels        achieved bandwidth and FLOP rate of the kernels the simulator prices (kernels_bench.py): SGLang
                 v0.4's two-stage grouped MLA decode, the absorbed MLA extend, the fused MoE at DeepSeek-V2/V3's
                 per-GPU expert shapes in bf16 and fp8, each beside the roofline's prediction
                 (kernel_efficiency.py turns the JSON into data/gpu-profiles/kernel_efficiency_<gpu>.json)
  tune_*         the launch-config tuner on the default shapes (tiny model's, DeepSeek-V2-Lite's), time-bounded
  bench_moe      MoE layer steps by backend, and the fused kernel's own weight bandwidth against 4.8 TB/s
Without a GPU (and without --cpu-smoke) it says so in one line and exits 0, running nothing.

The device image may lack run.py's Hydra packages: their wheels in --wheels are then installed into a private folder
first (experiments/README.md, gpu_check, says how to make them).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOTAL_BUDGET_S = 470          # the 8-minute promise, less the set-up
SMOKE_TIMEOUT_S = 300         # per part on a (shared, slow) CPU
PEAK_GBS = 4800.0             # H200 HBM3e
# bf16 verify bound. Measured on the CPU (torch twin, 6 seeds, tp and dp_attn): a bf16 engine's logits differ from
# the fp32 reference computed on the same (bf16-rounded) weights by 0.03-0.29, for logits up to ~4.5, the same
# spread as the bf16 reference itself (0.14-0.29). 0.5 leaves ~1.7x headroom and still fails gross errors (a lost
# KV entry moves logits by 1.4-2.0); finer errors are fp32 verify's (atol 1e-4) and the kernel tests' (bf16 at 1.5%).
BF16_VERIFY_ATOL = 0.5
NEEDED_MODULES = ("hydra", "omegaconf", "yaml", "pydantic", "msgpack")   # not in the device image (run.py, the plugins)
GPU_TEST_PATHS = ("tests/gpu", "tests/kernels", "tests/dist/test_dist_nccl.py")
# The tuned tables of both shapes are shipped (the 2026-11-30 run): the searches are short re-checks now, which
# frees time for the kernels part
TUNE_SHAPES = {"tune_tiny": dict(experts=8, intermediate=64, hidden=128, top_k=2, search_s=3, timeout_s=13),
               "tune_v2lite": dict(experts=64, intermediate=1408, hidden=2048, top_k=6, search_s=18, timeout_s=30)}
KERNELS_TIMEOUT_S = 50
KERNELS_BUDGET_S = 38         # no new kernels row after this: the last one, the predictions and the JSON fit after
TAIL_CHARS = 3000


@dataclass
class Part:
    name: str
    timeout_s: float                         # on a GPU
    argv: Callable[[Path], list[str]]        # the part's own folder -> its command
    figures: Callable[[Path], dict]          # what it wrote there -> figures for the JSON
    headline: Callable[[dict], str]          # figures -> one line of the summary table


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def junit_figures(folder: Path) -> dict:
    if not (folder / "junit.xml").is_file():
        return {}
    root = ET.parse(folder / "junit.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}"
              for case in root.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "passed": passed, "failed_tests": failed}


def bench_moe_figures(folder: Path) -> dict:
    keep = ("shape", "batch_tokens", "backend", "tok_s", "step_ms", "host_syncs", "kernel_us", "weight_gbs",
            "peak_bw_frac", "kernel_config")
    records = read_json(folder / "bench_moe.json").get("records", [])
    return {"records": [{k: r[k] for k in keep if k in r} for r in records]}


def decode_headline(figures: dict) -> str:
    """Step ms by batch, eager | graph, and the graph runs' replayed/timed steps."""
    by_batch: dict[int, dict] = {}
    for r in figures["rows"]:
        by_batch.setdefault(r["batch"], {})[bool(r.get("cuda_graph"))] = r
    cells = []
    for b, runs in by_batch.items():
        eager, graph = runs.get(False), runs.get(True)
        cell = f"B={b} {eager['step_ms']:.2f}" if eager else f"B={b} -"
        if graph:
            timed = graph["graph_replayed_steps"] + graph["graph_eager_steps"]
            cell += f"|{graph['step_ms']:.2f} ({graph['graph_replayed_steps']:.0f}/{timed:.0f} replayed)"
        cells.append(cell)
    return "ms eager|graph: " + ", ".join(cells)


def bandwidth_headline(figures: dict) -> str:
    rows = [r for r in figures.get("records", []) if "peak_bw_frac" in r]
    big = [r for r in rows if r["shape"] != "tiny"] or rows   # tiny's weights sit in L2: the V2-Lite rows count
    return ", ".join(f"{r['shape']} B={r['batch_tokens']} {r['peak_bw_frac']:.0%}" for r in big) + " of peak"


def kernels_headline(figures: dict) -> str:
    """Rows measured, and each kernel's median time over the roofline's prediction."""
    records = figures.get("records", [])
    measured = [r for r in records if "time_s" in r]
    ratios: dict[str, list[float]] = {}
    for r in measured:
        if "measured_over_predicted" in r:
            ratios.setdefault(f"{r['kind']}{' ' + r['dtype'] if 'dtype' in r else ''}", []).append(
                r["measured_over_predicted"])
    medians = ", ".join(f"{k} x{sorted(v)[len(v) // 2]:.2g}" for k, v in ratios.items())
    return f"{len(measured)}/{len(records)} rows" + (f"; measured/roofline (median): {medians}" if medians else "")


def kernels_table(results: dict) -> str:
    """Every measured kernels row: time, achieved GB/s and TFLOP/s with their fractions of peak, the roofline's
    time and measured / predicted."""
    rows = [r for r in results["parts"].get("kernels", {}).get("figures", {}).get("records", []) if "time_s" in r]
    if not rows:
        return ""
    lines = [f"{'kernel':<40}{'us':>10}{'GB/s':>8}{'HBM':>6}{'TFLOP/s':>9}{'peak':>6}{'roofline us':>13}{'x':>6}"]
    for r in rows:
        if r["kind"] == "mla_decode":
            what = f"mla_decode H={r['heads']} B={r['batch']} ctx={r['context']}"
        elif r["kind"] == "mla_extend":
            what = f"mla_extend H={r['heads']} {r['prompts']}x{r['extend_len']}"
        else:
            what = f"{r['kind']} {r['shape']} {r['dtype']} T={r['batch']}"
        line = f"{what:<40}{r['time_s'] * 1e6:>10.1f}"
        if "predicted_s" in r:
            line += (f"{r['achieved_gb_s']:>8.0f}{r['hbm_frac']:>6.0%}{r['achieved_tflops']:>9.1f}"
                     f"{r['flops_frac']:>6.0%}{r['predicted_s'] * 1e6:>13.1f}{r['measured_over_predicted']:>6.2f}")
        lines.append(line)
    return "\n".join(lines)


def parts(gpu: bool, write_configs: bool) -> list[Part]:
    """Every part's command: the GPU run, or (gpu=False) the same code paths at tiny size on the CPU."""
    py, device = sys.executable, "cuda" if gpu else "cpu"
    # -v: if the part times out (its JUnit file is written at the end), the log still names every test's outcome.
    out = [Part("gpu_tests", 175,   # on a GPU tests/kernels' edge cases run compiled too; the smoke collects only
                lambda d: [py, "-m", "pytest", "-v", "-m", "not slow" if gpu else "gpu", "-p", "no:cacheprovider",
                           f"--junitxml={d / 'junit.xml'}", *GPU_TEST_PATHS],
                junit_figures,
                lambda f: f"{f['passed']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped")]
    for dtype, atol in (("float32", 1e-4), ("bfloat16", BF16_VERIFY_ATOL)):
        for par in ("tp", "dp_attn"):
            overrides = ["mode=verify", f"parallel={par}", "parallel.size=1", "moe=triton_fused",
                         # the compiled kernel on a GPU; the smoke takes the torch twin (interpreted: minutes)
                         f"moe.kernel={'triton' if gpu else 'torch'}", f"engine.device={device}",
                         f"model.dtype={dtype}", f"verify.atol={atol}", "logger.mode=disabled", "logger.plots=false",
                         *([] if gpu else ["verify.max_new_tokens=2"])]
            out.append(Part(f"verify_{par}_{'fp32' if dtype == 'float32' else 'bf16'}", 26,
                            lambda d, o=overrides: [py, "run.py", *o, f"hydra.run.dir={d}"],
                            lambda d: {k: v for k, v in read_json(d / "results.json").items()
                                       if k.startswith("verify_") or k.endswith("max_abs_err")},
                            lambda f: f"max abs logit error {f['verify_max_abs_err']:.3g} (atol {f['verify_atol']})"))
    decode = (["--batches", "1", "8", "32", "64", "256", "--contexts", "256", "--steps", "20", "--repeats", "2",
               "--cuda-graph-max-bs", "256"] if gpu
              else ["--batches", "1", "2", "--contexts", "8", "--steps", "2", "--repeats", "1"])
    out.append(Part("decode_step", 55,
                    lambda d: [py, "experiments/decode_step/bench.py", "--device", device, "--moe", "triton_fused",
                               "--cuda-graph", "both", *decode, "--out", str(d / "decode_step.json")],
                    lambda d: read_json(d / "decode_step.json"), decode_headline))
    kernels = ["--budget-s", str(KERNELS_BUDGET_S)] if gpu else ["--tiny"]
    out.append(Part("kernels", KERNELS_TIMEOUT_S,
                    lambda d: [py, "experiments/gpu_check/kernels_bench.py", "--device", device, *kernels,
                               "--out", str(d / "kernels.json")],
                    lambda d: read_json(d / "kernels.json"), kernels_headline))
    for name, s in TUNE_SHAPES.items():
        shape = [s["experts"], s["intermediate"], s["hidden"], s["top_k"]] if gpu else [4, 16, 32, 2]
        search = (["--batch-sizes", "1", "2", "4", "8", "16", "32", "64", "128", "256", "--budget-s",
                   str(s["search_s"]), "--dtype", "bfloat16"] if gpu else
                  ["--batch-sizes", "1", "3", "--budget-s", "60", "--max-configs", "2", "--repeats", "1",
                   "--dtype", "float32", "--device", "cpu"])
        out.append(Part(name, s["timeout_s"],
                        lambda d, shape=shape, search=search: [
                            py, "-m", "kernels.tune_fused_moe", *search, "--json-out", str(d / "tuned.json"),
                            *(["--out-dir", str(d)] if not (gpu and write_configs) else []),
                            *(a for flag, v in zip(("--experts", "--intermediate", "--hidden", "--top-k"), shape)
                              for a in (flag, str(v)))],
                        lambda d: read_json(d / "tuned.json"),
                        lambda f: ", ".join(f"M={m} {t['ms'] * 1e3:.1f} us ({t['shipped_ms'] * 1e3:.1f} shipped)"
                                            for m, t in f["timings"].items())))
    bench = (["--shapes", "tiny,v2lite", "--v2lite-scale", "1", "--batch-sizes", "1,8,32,64,256", "--budget-s", "0.1"]
             if gpu else ["--shapes", "tiny", "--batch-sizes", "1,4", "--budget-s", "0.001"])
    out.append(Part("bench_moe", 43,
                    lambda d: [py, "experiments/bench_moe/bench.py", "--sizes", "1", "--runs", "1", *bench,
                               "--peak-gbs", str(PEAK_GBS), "--out", str(d / "bench_moe.json")],
                    bench_moe_figures, bandwidth_headline))
    return out


def ensure_packages(wheels: Path, site: Path) -> dict:
    """Install the wheels in ``wheels`` into ``site`` when a module the parts need is missing (the device image has
    no Hydra); returns what happened, for the JSON."""
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return {"missing": []}
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return {"missing": missing, "problem": f"no wheels in {wheels}: the verify parts will fail"}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(site), *map(str, found)], capture_output=True, text=True, timeout=120)
    return {"missing": missing, "installed": [w.name for w in found], "pip_rc": proc.returncode,
            "pip_tail": (proc.stdout + proc.stderr)[-TAIL_CHARS:]}


def run_part(part: Part, timeout_s: float, env: dict, folder: Path, log) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    argv = part.argv(folder)
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        status, rc, output = ("ok" if proc.returncode == 0 else "failed"), proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status, rc = "timeout", None
        output = "".join(b.decode(errors="replace") if isinstance(b, bytes) else b or "" for b in (exc.stdout, exc.stderr))
    wall_s = time.monotonic() - start
    log.write(f"\n===== {part.name}: {status} after {wall_s:.1f} s =====\n$ {' '.join(argv)}\n{output}")
    log.flush()
    try:   # a part that failed may still have written figures (verify writes results.json before exiting 2)
        figures = part.figures(folder)
        headline = part.headline(figures) if figures else ""
    except Exception as exc:  # noqa: BLE001 - one part's broken output must not lose the others
        figures, headline = {}, f"no figures: {type(exc).__name__}: {exc}"
    return {"status": status, "rc": rc, "wall_s": round(wall_s, 1), "timeout_s": timeout_s, "headline": headline,
            "figures": figures, "tail": output[-TAIL_CHARS:]}


def summary_table(results: dict) -> str:
    lines = [f"{'part':<21}{'status':<9}{'wall s':>7}  figures", "-" * 110]
    lines += [f"{name:<21}{r['status']:<9}{r['wall_s']:>7.1f}  {r['headline']}" for name, r in results["parts"].items()]
    return "\n".join(lines)


def bandwidth_table(results: dict) -> str:
    """The fused kernel's weight bandwidth at the V2-Lite shape: the tuner's best and shipped configs, bench_moe's."""
    parts = results["parts"]
    tuned = parts.get("tune_v2lite", {}).get("figures", {}).get("timings", {})
    bench = {r["batch_tokens"]: r for r in parts.get("bench_moe", {}).get("figures", {}).get("records", [])
             if "weight_gbs" in r and r["shape"] != "tiny"}
    if not tuned and not bench:
        return ""
    peak = results["meta"]["peak_gbs"]
    lines = [f"fused kernel alone (expert_gemms), V2-Lite layer, weight GB/s and % of {peak:.0f}",
             f"{'batch':>6}{'tuned us':>10}{'GB/s':>7}{'%':>5}{'shipped us':>12}{'GB/s':>7}{'%':>5}"
             f"{'bench_moe us':>14}{'GB/s':>7}{'%':>5}"]
    for m in sorted({int(m) for m in tuned} | set(bench)):
        t, b = tuned.get(str(m)), bench.get(m)
        cells = [f"{m:>6}"]
        for us, gbs, width in ((t and t["ms"] * 1e3, t and t["weight_gbs"], 10),
                               (t and t["shipped_ms"] * 1e3, t and t["shipped_weight_gbs"], 12),
                               (b and b["kernel_us"], b and b["weight_gbs"], 14)):
            cells.append(f"{us:>{width}.1f}{gbs:>7.0f}{gbs / peak:>5.0%}" if us else " " * (width + 12))
        lines.append("".join(cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    ap.add_argument("--cpu-smoke", action="store_true", help="every part at tiny size on the CPU (tests the script)")
    ap.add_argument("--write-configs", action="store_true", help="the tuner writes into kernels/configs/, so "
                    "bench_moe (after it) uses its configs; the JSON holds them either way")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels of missing packages (Hydra)")
    ap.add_argument("--parts", help="comma-separated part names to run (default: all), e.g. to rerun failed ones")
    ap.add_argument("--apply-tuned", type=Path, help="write the tuned configs of this results JSON and exit")
    args = ap.parse_args()
    if args.apply_tuned:
        return apply_tuned(args.apply_tuned)
    import torch
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not gpu and not args.cpu_smoke:
        print(f"gpu_check: no CUDA device visible (torch {torch.__version__}); nothing to run "
              "(--cpu-smoke tests this script on the CPU)")
        return 0
    todo = parts(gpu, args.write_configs)
    if args.parts:
        wanted, known = args.parts.split(","), [p.name for p in todo]
        if unknown := [name for name in wanted if name not in known]:
            ap.error(f"unknown parts {unknown}; the parts are {', '.join(known)}")
        todo = [p for p in todo if p.name in wanted]

    from framework.core.paths import git_sha
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "TRITON_CACHE_DIR": str(work / "triton_cache")}   # shared by the parts: each kernel compiles once
    if not gpu:   # one thread per part: spinning OpenMP threads of concurrent jobs slow a shared CPU tenfold
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    setup = ensure_packages(args.wheels, work / "site")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(work / "site"), env.get("PYTHONPATH")) if p)
    results = {"meta": {"gpu": torch.cuda.get_device_name() if gpu else None, "cpu_smoke": not gpu,
                        "python": platform.python_version(), "torch": torch.__version__,
                        "triton": _triton_version(),
                        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_sha": git_sha(), "work_dir": str(work),
                        "peak_gbs": PEAK_GBS, "bf16_verify_atol": BF16_VERIFY_ATOL, "setup": setup},
               "parts": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(args.out.with_suffix(".log"), "w") as log:
        for part in todo:
            timeout_s = min(part.timeout_s, TOTAL_BUDGET_S - (time.monotonic() - start)) if gpu else SMOKE_TIMEOUT_S
            if timeout_s < 5:
                results["parts"][part.name] = {"status": "skipped", "rc": None, "wall_s": 0.0, "timeout_s": 0,
                                               "headline": "the 8-minute budget was spent", "figures": {}, "tail": ""}
            else:
                print(f"gpu_check: {part.name} (timeout {timeout_s:.0f} s)", flush=True)
                results["parts"][part.name] = run_part(part, timeout_s, env, work / part.name, log)
            results["meta"]["wall_s"] = round(time.monotonic() - start, 1)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(summary_table(results))
    print(bandwidth_table(results))
    print(kernels_table(results))
    print(f"results: {args.out} (every part's full output: {args.out.with_suffix('.log')})")
    return 0 if all(r["status"] == "ok" for r in results["parts"].values()) else 1


def apply_tuned(path: Path) -> int:
    """Write the tuner parts' tables of a results JSON into kernels/configs/ (merged into the existing files)."""
    import torch

    from kernels.tune_fused_moe import write_configs
    for name, part in json.loads(path.read_text())["parts"].items():
        tuned = part.get("figures") or {}
        if name.startswith("tune_") and tuned.get("table"):
            s, table = tuned["shape"], {int(m): cfg for m, cfg in tuned["table"].items()}
            dtype = getattr(torch, s["dtype"])
            written = write_configs(table, s["experts"], s["intermediate"], tuned["device_name"],
                                    ROOT / "kernels" / "configs", dtype)
            print(f"wrote {written}")
    return 0


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
