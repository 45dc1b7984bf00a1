"""Achieved bandwidth and FLOP rate of the kernels the simulator's cost model prices, each beside the roofline's
prediction (gpu_check's `kernels` part; experiments/README.md, gpu_check):

  mla_decode  kernels/mla_decode.py, SGLang v0.4's two-stage grouped MLA decode (8 KV splits, 16-head blocks),
              bf16 latent 512 + 64, at batch 64..1,024, 16 heads (TP 8 of 128) and 128 (DP attention), contexts 256
              (PR #1970's decode: input 1, output 512, so the mean context is ~256), 1,024 and 4,096 (long contexts,
              where the latent stream dominates and the fixed costs fade)
  mla_extend  kernels/mla_extend.py, absorbed extend, 512-token prompts without a prefix, 8 and 16 prompts per call
              (PR #1970's prefill chunks: 4,096 tokens per DP rank, 8,192 under TP), 16 and 128 heads
  fused_moe   kernels/fused_moe.py's expert GEMMs (+ SiLU-and-mul) at DeepSeek-V2's per-GPU shape (E=160, 2N=384,
              K=5120, top 6) and V3's (E=256, 2N=512, K=7168, top 8), bf16 and fp8 (kernels/fused_moe_fp8.py: w8a8,
              per-tensor scales; fp8 rows also time the two activation quantizations alone, `quant_s`)

Times are device times of CUDA-graph replays (kernels.timing); where one call's data would fit the 60 MB L2, each
timed replay cycles through enough disjoint inputs to exceed 256 MB (`rotations`). Rows run in that order (decode,
extend, then V2 fp8, V2 bf16, V3 fp8, V3 bf16: PR #1970's model first) until --budget-s has passed; the JSON is
rewritten after every row, so a timeout keeps what finished. `--tiny` runs every row kind at toy sizes (the CPU smoke:
the interpreter, float32; fp8 is recorded as unsupported there).

    python experiments/gpu_check/kernels_bench.py --out kernels.json [--device cuda] [--budget-s 42] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
ROTATION_BYTES = 256 * 2**20     # more than the H200's L2 (60 MB), so each replay streams from HBM
MAX_ROTATIONS = 16
FULL = dict(v_dim=512, rope_dim=64, decode_batches=(64, 128, 256, 512, 1024), heads=(16, 128),
            contexts=(256, 1024, 4096), extend_prompts=(8, 16), extend_len=512, moe_batches=(1, 64, 256, 1024, 4096),
            moe_shapes={"v2": dict(experts=160, inter=192, hidden=5120, top_k=6),
                        "v3": dict(experts=256, inter=256, hidden=7168, top_k=8)})
TINY = dict(v_dim=32, rope_dim=16, decode_batches=(2,), heads=(4, 20), contexts=(24,), extend_prompts=(2,),
            extend_len=24, moe_batches=(3,), moe_shapes={"tiny": dict(experts=4, inter=16, hidden=32, top_k=2)})


def rotation_count(nbytes: float, device: torch.device) -> int:
    """Disjoint inputs per timed replay so that together they exceed the L2 (one off CUDA)."""
    return min(MAX_ROTATIONS, max(1, math.ceil(ROTATION_BYTES / nbytes))) if device.type == "cuda" else 1


def timing(device: torch.device) -> dict:
    return dict(repeats=5, replays=3) if device.type == "cuda" else dict(repeats=1, replays=1)


def decode_row(batch: int, heads: int, context: int, dims: dict, dtype: torch.dtype, device: torch.device) -> dict:
    from kernels.mla_decode import mla_decode_traffic, mla_decode_triton
    from kernels.timing import device_time_ms
    width, itemsize = dims["v_dim"] + dims["rope_dim"], torch.finfo(dtype).bits // 8
    traffic = mla_decode_traffic(batch, heads, context, v_dim=dims["v_dim"], rope_dim=dims["rope_dim"],
                                 itemsize=itemsize)
    n = rotation_count(traffic["latent_once_bytes"], device)
    kv = torch.randn(n * batch * context, width, device=device).to(dtype)
    tables = torch.randperm(kv.shape[0], device=device).to(torch.int32).view(n, batch, context)  # scattered slots
    q = torch.randn(batch, heads, width, device=device).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)

    def run() -> None:
        for table in tables:
            mla_decode_triton(q, kv, table, lens, width**-0.5, v_dim=dims["v_dim"])
    seconds = device_time_ms(run, device, **timing(device)) / n * 1e-3
    # what the roofline cost model charges (plugins/cost/roofline.py): the latent once per 16-head block, q and out
    model_bytes = traffic["latent_once_bytes"] * traffic["head_blocks"] + batch * heads * (width + dims["v_dim"]) * 2
    return {"time_s": seconds, "flops": traffic["flops"], "bytes": traffic["bytes"], "model_bytes": model_bytes,
            "rotations": n, "stage2_bytes": traffic["stage2_bytes"], "element_dtype": str(dtype)}


def extend_row(prompts: int, heads: int, extend_len: int, dims: dict, dtype: torch.dtype,
               device: torch.device) -> dict:
    from kernels.mla_extend import mla_extend_traffic, mla_extend_triton
    from kernels.timing import device_time_ms
    width, itemsize = dims["v_dim"] + dims["rope_dim"], torch.finfo(dtype).bits // 8
    traffic = mla_extend_traffic(prompts, heads, extend_len, v_dim=dims["v_dim"], rope_dim=dims["rope_dim"],
                                 itemsize=itemsize)
    tokens = prompts * extend_len
    q = torch.randn(tokens, heads, width, device=device).to(dtype)
    new = torch.randn(tokens, width, device=device).to(dtype)
    kv = torch.zeros(1, width, device=device, dtype=dtype)                      # no prefix: the cache is not read
    table = torch.zeros(prompts, 1, dtype=torch.int32, device=device)
    prefix_lens = torch.zeros(prompts, dtype=torch.int32, device=device)
    extend_lens = torch.full((prompts,), extend_len, dtype=torch.int32, device=device)

    def run() -> None:
        mla_extend_triton(q, new, kv, table, prefix_lens, extend_lens, width**-0.5, v_dim=dims["v_dim"],
                          max_extend_len=extend_len)
    seconds = device_time_ms(run, device, **timing(device)) * 1e-3
    return {"time_s": seconds, "flops": traffic["flops"], "bytes": traffic["bytes"],
            "model_bytes": traffic["once_bytes"], "element_dtype": str(dtype)}


def fp8_unsupported(device: torch.device) -> str | None:
    """Why the fp8 rows cannot run here, or None: Triton's fp8 dots need sm_89 or later."""
    if device.type != "cuda":
        return "fp8 needs a CUDA device (the interpreter has no fp8 dot)"
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"fp8 dots need sm_89+, this is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return None


def moe_weights(shape: dict, dtype: str, device: torch.device) -> tuple:
    """(w13, w13_scale, w2, w2_scale): random bf16 (float32 off CUDA) weights, quantized for fp8 (scales None for
    bf16). Drawn on the device: gigabytes of host randn would take most of the budget."""
    gen = torch.Generator(device=device).manual_seed(0)
    e, i, h = shape["experts"], shape["inter"], shape["hidden"]
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=device) / h**0.5).to(act)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) / i**0.5).to(act)
    if dtype == "bf16":
        return w13, None, w2, None
    from kernels.fused_moe_fp8 import quantize_weights
    return (*quantize_weights(w13), *quantize_weights(w2))


def moe_row(shape: dict, weights: tuple, batch: int, dtype: str, device: torch.device) -> dict:
    from kernels.fused_moe_fp8 import expert_gemms_fp8, quantize_per_tensor
    from kernels.moe_align import moe_align_block_size
    from kernels.timing import device_time_ms
    from kernels.tune_fused_moe import expert_bytes, random_router, rotations
    from kernels.tuning import get_config
    w13, s13, w2, s2 = weights
    e, i, h, k = shape["experts"], shape["inter"], shape["hidden"], shape["top_k"]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    config = get_config(e, i, device_name, batch, dtype="float32" if w13.dtype == torch.float32 else None)
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(batch, h, device=device).to(act)
    routings = rotations(random_router(batch, e, k, torch.Generator().manual_seed(batch)), expert_bytes(w13, w2),
                         device)
    cases = [(ids.reshape(-1), w.reshape(-1).float().contiguous(), moe_align_block_size(ids, config["BLOCK_SIZE_M"], e),
              hidden.new_zeros((ids.numel(), h))) for ids, w in routings]
    if dtype == "bf16":
        from kernels.fused_moe import expert_gemms

        def run() -> None:
            for _, w, aligned, out in cases:
                expert_gemms(hidden, w13, w2, w, aligned, k, config, True, out)
    else:
        def run() -> None:
            for ids, w, aligned, out in cases:
                expert_gemms_fp8(hidden, w13, s13, w2, s2, ids, w, aligned, k, config, out)
    seconds = device_time_ms(run, device, **timing(device)) / len(cases) * 1e-3
    touched = sum(ids.unique().numel() for ids, *_ in cases) / len(cases)
    rows = batch * k
    weight_bytes = touched * expert_bytes(w13, w2)
    # bytes: the touched experts' weights once, the input once, and the [T*k, .] activations each launch moves
    # (gate/up out 2I, SiLU in 2I and out I, down in I and out H)
    record = {**shape, "time_s": seconds, "flops": 2.0 * rows * 3 * i * h, "touched_experts": touched,
              "weight_bytes": weight_bytes, "bytes": weight_bytes + (batch * h + rows * (6 * i + h)) * 2,
              "rotations": len(cases), "config": config, "element_dtype": str(w13.dtype)}
    if dtype == "fp8":   # the quantizations alone: the input [T, H] and the SiLU output [T*k, I]
        mid = torch.randn(rows, i, device=device).to(act)
        record["quant_s"] = device_time_ms(lambda: (quantize_per_tensor(hidden), quantize_per_tensor(mid)), device,
                                           **timing(device)) * 1e-3
        record["quant_bytes"] = (batch * h + rows * i) * (2 + 2 + 1)      # amax read, scaled read, fp8 write
    return record


def plan(dims: dict) -> list[dict]:
    """Every row, in the order they run (the most needed first)."""
    rows = [dict(kind="mla_decode", heads=hd, context=c, batch=b) for c in dims["contexts"] for hd in dims["heads"]
            for b in dims["decode_batches"]]
    rows += [dict(kind="mla_extend", heads=hd, prompts=p, extend_len=dims["extend_len"], prefix_len=0)
             for hd in dims["heads"] for p in dims["extend_prompts"]]
    for name in dims["moe_shapes"]:
        rows += [dict(kind="fused_moe", shape=name, dtype=dt, batch=b) for dt in ("fp8", "bf16")
                 for b in dims["moe_batches"]]
    return rows


def measure(row: dict, dims: dict, device: torch.device, moe_cache: dict) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # the interpreter's bf16 dot is wrong
    if row["kind"] == "mla_decode":
        return decode_row(row["batch"], row["heads"], row["context"], dims, dtype, device)
    if row["kind"] == "mla_extend":
        return extend_row(row["prompts"], row["heads"], row["extend_len"], dims, dtype, device)
    if row["dtype"] == "fp8" and (reason := fp8_unsupported(device)):
        return {"skipped": reason}
    key = (row["shape"], row["dtype"])
    if key not in moe_cache:
        moe_cache.clear()                                               # one shape's weights at a time
        moe_cache[key] = moe_weights(dims["moe_shapes"][row["shape"]], row["dtype"], device)
    return moe_row(dims["moe_shapes"][row["shape"]], moe_cache[key], row["batch"], row["dtype"], device)


def run_all(dims: dict, device: torch.device, budget_s: float, out: Path, meta: dict) -> dict:
    start, results, moe_cache = time.monotonic(), {"meta": meta, "records": []}, {}
    for row in plan(dims):
        if time.monotonic() - start > budget_s:
            record = {"skipped": f"the {budget_s:.0f} s budget was spent"}
        else:
            try:
                record = measure(row, dims, device, moe_cache)
            except Exception as exc:  # noqa: BLE001 - one row's failure (a compile error, OOM) must not lose the rest
                record = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results["records"].append({**row, **record})
        print(json.dumps(results["records"][-1]), flush=True)
        meta["wall_s"] = round(time.monotonic() - start, 1)
        out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=42.0, help="no new row after this long")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU smoke)")
    ap.add_argument("--hardware", default="h200", help="conf/hardware/<name>.yaml: the spec the roofline predicts with")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before any kernel module is imported
    import triton

    from framework.core.paths import git_sha
    dims = TINY if args.tiny else FULL
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "git_sha": git_sha(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "tiny": args.tiny, "budget_s": args.budget_s, "v_dim": dims["v_dim"], "rope_dim": dims["rope_dim"]}
    results = run_all(dims, device, args.budget_s, args.out, meta)
    from experiments.gpu_check.kernel_efficiency import add_predictions
    add_predictions(results, args.hardware)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    measured = [r for r in results["records"] if "time_s" in r]
    print(f"kernels: {len(measured)} of {len(results['records'])} rows measured; {args.out}")
    return 0 if measured and not any("error" in r for r in results["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
