"""The roofline's prediction beside each measurement of gpu_check's `kernels` part, and the data file a cost model
can read: data/gpu-profiles/kernel_efficiency_<gpu>.json, written only from a real GPU run.

    python experiments/gpu_check/kernel_efficiency.py RESULTS.json [--hardware h200] [--out-dir data/gpu-profiles]

RESULTS.json: what experiments/gpu_check/run.py wrote (its `kernels` part), or kernels_bench.py's own JSON.
Predictions use framework/gpu/roofline.py with conf/hardware/<hardware>.yaml and the efficiency terms it names,
charging each kernel what plugins/cost/roofline.py charges it today: MLA decode and extend through
`Roofline.attention(flops, bytes)` (the latent once per 16-head block for decode, once for extend; q and out), the
expert GEMMs as two batched GEMMs over the experts the routing touched plus the SiLU-and-mul, the fp8 quantizations
as elementwise kernels. `measured_over_predicted` > 1: the kernel is slower than the cost model assumes.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
CAVEAT = ("Measured on this GPU with the Triton and torch named here, with kernels written in servelab from SGLang "
          "v0.4's designs. An H200 with today's Triton is not the 2024 H100 (HBM3 at 3.35 TB/s, Triton 3.1) that "
          "SGLang v0.4's published figures ran on: carry the fractions of peak (hbm_frac, flops_frac) and the "
          "measured/predicted ratios to other GPUs, not the times, and treat them as an estimate of 2024's kernels.")


def load_hardware(name: str):
    """conf/hardware/<name>.yaml as a HardwareConfig, without Hydra (the device image may lack it)."""
    import yaml

    from framework.gpu.hardware import HardwareConfig
    spec = yaml.safe_load((ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
    return HardwareConfig(**{k: v for k, v in spec.items() if k != "defaults"})


def predicted_s(record: dict, rf) -> float:
    """The roofline cost model's time for the measured call."""
    if record["kind"] in ("mla_decode", "mla_extend"):
        return rf.attention(record["flops"], record["model_bytes"])
    dtype, wbytes = ("fp8", 1) if record["dtype"] == "fp8" else ("bfloat16", 2)
    touched, rows = record["touched_experts"], record["batch"] * record["top_k"]
    i, h = record["inter"], record["hidden"]
    gemm = dict(batch=touched, dtype=dtype, weight_bytes=wbytes, act_bytes=2)
    return (rf.gemm(rows / touched, 2 * i, h, **gemm) + rf.memop("act", rows * 3 * i * 2)
            + rf.gemm(rows / touched, h, i, **gemm))


def add_predictions(results: dict, hardware: str = "h200") -> None:
    """Add to every measured record: achieved GB/s and TFLOP/s, their fractions of the spec's peaks, the roofline's
    time and measured / predicted (fp8 rows: the same for their quantizations). Records a reason in meta instead
    when the spec cannot be loaded."""
    try:
        from framework.gpu.roofline import Roofline
        hw = load_hardware(hardware)
        rf = Roofline(hw)
    except Exception as exc:  # noqa: BLE001 - the measurements stand without predictions
        results["meta"]["prediction_problem"] = f"{type(exc).__name__}: {exc}"
        return
    results["meta"]["predicted_with"] = {"hardware": hw.name, "hbm_gb_s": hw.hbm_gb_s, "bf16_tflops": hw.bf16_tflops,
                                         "fp8_tflops": hw.fp8_tflops, "fit": hw.fit}
    for r in results["records"]:
        if "time_s" not in r:
            continue
        peak = hw.peak_flops("fp8" if r.get("dtype") == "fp8" else "bfloat16")
        r["achieved_gb_s"] = r["bytes"] / r["time_s"] / 1e9
        r["achieved_tflops"] = r["flops"] / r["time_s"] / 1e12
        r["hbm_frac"] = r["achieved_gb_s"] / hw.hbm_gb_s
        r["flops_frac"] = r["flops"] / r["time_s"] / peak
        r["predicted_s"] = predicted_s(r, rf)
        r["measured_over_predicted"] = r["time_s"] / r["predicted_s"]
        if "quant_s" in r:
            r["quant_predicted_s"] = rf.memop("act", r["quant_bytes"])
            r["quant_measured_over_predicted"] = r["quant_s"] / r["quant_predicted_s"]


def kernels_figures(results: dict) -> tuple[dict, dict]:
    """(the kernels part's figures, the run's meta) from a gpu_check JSON, or a kernels_bench JSON and its meta."""
    if "parts" in results:
        return results["parts"].get("kernels", {}).get("figures") or {}, results.get("meta", {})
    return results, results.get("meta", {})


def efficiency_file(results: dict, hardware: str) -> dict:
    """The data file's content. Raises ValueError unless the results are a real GPU run with measured rows."""
    figures, run_meta = kernels_figures(results)
    meta, records = figures.get("meta", {}), figures.get("records", [])
    measured = [r for r in records if "time_s" in r]
    if run_meta.get("cpu_smoke") or meta.get("tiny") or meta.get("device", "cpu") == "cpu" or not measured:
        raise ValueError("not a GPU run of the kernels part (a CPU smoke, toy sizes, or no measured row): the "
                         "efficiency file is written only from real GPU measurements")
    add_predictions(figures, hardware)
    keep = ("kind", "heads", "batch", "context", "prompts", "extend_len", "prefix_len", "shape", "dtype", "experts",
            "inter", "hidden", "top_k", "touched_experts", "time_s", "flops", "bytes", "model_bytes", "achieved_gb_s",
            "achieved_tflops", "hbm_frac", "flops_frac", "predicted_s", "measured_over_predicted", "quant_s",
            "quant_predicted_s", "quant_measured_over_predicted")
    rows = [{k: r[k] for k in keep if k in r} for r in measured]
    summary = {}
    for kind in sorted({(r["kind"], r.get("dtype", "bf16")) for r in rows}):
        ratios = [r["measured_over_predicted"] for r in rows if (r["kind"], r.get("dtype", "bf16")) == kind
                  and "measured_over_predicted" in r]
        if ratios:
            summary["/".join(kind)] = {"rows": len(ratios), "median_measured_over_predicted": statistics.median(ratios),
                                       "min": min(ratios), "max": max(ratios)}
    return {"gpu": meta["device"], "torch": meta.get("torch"), "triton": meta.get("triton"),
            "git_sha": run_meta.get("git_sha") or meta.get("git_sha"), "date": run_meta.get("date") or meta.get("date"),
            "caveat": CAVEAT,
            "source": "experiments/gpu_check/run.py (kernels part: kernels_bench.py), kernel_efficiency.py",
            "predicted_with": figures["meta"].get("predicted_with"),
            "skipped_rows": len(records) - len(measured), "summary": summary, "rows": rows}


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200": the file name's GPU part."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().removeprefix("nvidia").strip()).strip("_")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--hardware", default="h200", help="conf/hardware/<name>.yaml for the predictions")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "data" / "gpu-profiles")
    args = ap.parse_args()
    try:
        content = efficiency_file(json.loads(args.results.read_text()), args.hardware)
    except ValueError as exc:
        print(f"kernel_efficiency: {exc}")
        return 2
    path = args.out_dir / f"kernel_efficiency_{gpu_slug(content['gpu'])}.json"
    path.write_text(json.dumps(content, indent=1) + "\n")
    print(f"wrote {path} ({len(content['rows'])} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
