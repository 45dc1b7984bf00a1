"""Compile the fused MoE kernels for Hopper (sm_90) without a GPU and print what came out, as JSON (run by
test_fused_moe.py in a process without TRITON_INTERPRET). Arguments are specialised as a launch would: unit strides
constant, the other integers and the pointers divisible by 16."""
import json
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.fused_moe import fused_moe_kernel, silu_and_mul_kernel  # noqa: E402

GEMM_INTS = ("N", "K", "EM", "num_valid_slots", "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk",
             "stride_cm", "stride_cn")
GEMM_CONSTEXPRS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "TOP_K", "MUL_ROUTED_WEIGHT",
                   "FP32_IEEE", "EVEN_K")


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 2):
    names = list(signature)
    sig = {n: "constexpr" if n in constexprs else t for n, t in signature.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n != "num_valid_slots"}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


def gemm(name: str, dtype: str, tiles: dict, top_k: int, mul_weight: bool, num_warps: int, num_stages: int) -> dict:
    signature = {**{n: f"*{dtype}" for n in ("a_ptr", "b_ptr", "c_ptr")}, "topk_weights_ptr": "*fp32",
                 **{n: "*i32" for n in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr")},
                 **{n: "i32" for n in GEMM_INTS}, **{n: "constexpr" for n in GEMM_CONSTEXPRS}}
    constexprs = {**tiles, "TOP_K": top_k, "MUL_ROUTED_WEIGHT": mul_weight, "FP32_IEEE": dtype == "fp32",
                  "EVEN_K": True, "stride_ak": 1, "stride_bk": 1, "stride_cn": 1}
    return summary(name, compile_sm90(fused_moe_kernel, signature, constexprs, num_warps, num_stages), num_stages)


def summary(name: str, compiled, num_stages: int) -> dict:
    ptx = compiled.asm["ptx"]
    return {"name": name, "num_stages": num_stages, "shared_bytes": compiled.metadata.shared,
            "cp_async": len(re.findall(r"cp\.async\.", ptx)), "wgmma": len(re.findall(r"wgmma\.", ptx))}


def main() -> None:
    tiles = lambda m, n, k, g: dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=g)  # noqa: E731
    out = [gemm("decode_bf16", "bf16", tiles(16, 64, 128, 1), 6, False, 4, 3),
           gemm("prefill_bf16", "bf16", tiles(64, 128, 64, 8), 1, True, 4, 3),
           gemm("fp32_ieee", "fp32", tiles(64, 64, 32, 8), 2, True, 4, 2)]
    act = compile_sm90(silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "I": "i32", "stride_xm": "i32",
                                             "stride_om": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024})
    out.append(summary("silu_and_mul_bf16", act, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
