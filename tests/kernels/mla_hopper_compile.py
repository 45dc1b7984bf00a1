"""Compile the MLA decode and extend kernels (DeepSeek's 576-wide latent, bf16, the launch settings
experiments/gpu_check measures) and the fp8 grouped GEMM for Hopper (sm_90) without a GPU, and print what came out
as JSON (run by test_mla_kernels.py in a process without TRITON_INTERPRET). Pointers are taken as 16-byte aligned,
as a launch would find them; integers are left unspecialised."""
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import fused_moe, mla_decode, mla_extend  # noqa: E402
from kernels.tuning import default_config  # noqa: E402

H200_SHARED_BYTES = 232448     # the most shared memory one block may use on sm_90 (227 KiB)


def compile_kernel(name, kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """``types``: each runtime argument's Triton type in the kernel's order, constexprs after them."""
    names = [*types, *constexprs]
    src = ASTSource(fn=kernel, signature={**types, **{n: "constexpr" for n in constexprs}},
                    constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, t in enumerate(types.values()) if t[0] == "*"})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return {"name": name, "shared_bytes": compiled.metadata.shared, "num_warps": num_warps,
            "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")}


def ints(*names: str) -> dict:
    return {n: "i32" for n in names}


def mla(dtype: str = "bf16") -> list[dict]:
    latent = dict(V_DIM=512, ROPE_DIM=64, BLOCK_V=512, BLOCK_R=64)
    stage1 = compile_kernel(
        "mla_decode_stage1", mla_decode.mla_decode_stage1_kernel,
        {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "page_table_ptr": "*i32", "seq_lens_ptr": "*i32",
         "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sm_scale": "fp32", "num_heads": "i32",
         **ints("stride_qb", "stride_qh", "stride_kv", "stride_pt", "stride_pob", "stride_poh", "stride_pos",
                "stride_plb", "stride_plh")},
        {**latent, "BLOCK_H": mla_decode.BLOCK_H, "BLOCK_N": mla_decode.BLOCK_N,
         "NUM_KV_SPLITS": mla_decode.NUM_KV_SPLITS, "FP32_IEEE": False},
        mla_decode.NUM_WARPS, mla_decode.NUM_STAGES)
    stage2 = compile_kernel(
        "mla_decode_stage2", mla_decode.mla_decode_stage2_kernel,
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": f"*{dtype}",
         **ints("stride_pob", "stride_poh", "stride_pos", "stride_plb", "stride_plh", "stride_ob", "stride_oh")},
        {"V_DIM": 512, "BLOCK_V": 512, "NUM_KV_SPLITS": mla_decode.NUM_KV_SPLITS}, 4, 2)
    extend = compile_kernel(
        "mla_extend", mla_extend.mla_extend_kernel,
        {"q_ptr": f"*{dtype}", "new_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "page_table_ptr": "*i32",
         "prefix_lens_ptr": "*i32", "extend_lens_ptr": "*i32", "extend_starts_ptr": "*i32", "out_ptr": f"*{dtype}",
         "sm_scale": "fp32",
         **ints("stride_qt", "stride_qh", "stride_new", "stride_kv", "stride_pt", "stride_ot", "stride_oh")},
        {**latent, "BLOCK_M": mla_extend.BLOCK_M, "BLOCK_N": mla_extend.BLOCK_N, "FP32_IEEE": False},
        mla_extend.NUM_WARPS, mla_extend.NUM_STAGES)
    return [stage1, stage2, extend]


def fp8_gemms() -> list[dict]:
    """fused_moe_kernel on fp8 inputs (bf16 out, the per-slot scale as its weight), at the default configs of a
    decode-sized and a prefill-sized batch (the ones experiments/gpu_check's fp8 rows get), and the GPU test's small
    tiles with a ragged K (32 along K: fp8 dots fail to compile below)."""
    out = []
    small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 2, "num_warps": 4,
             "num_stages": 2}
    for name, cfg, even_k in (("fp8_gemm_decode", default_config(256, 1), True),
                              ("fp8_gemm_prefill", default_config(256, 4096), True), ("fp8_gemm_test", small, False)):
        out.append(compile_kernel(
            name, fused_moe.fused_moe_kernel,
            {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "topk_weights_ptr": "*fp32",
             "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32",
             **ints("N", "K", "EM", "num_valid_slots", "stride_am", "stride_ak", "stride_be", "stride_bn",
                    "stride_bk", "stride_cm", "stride_cn")},
            {**{k: cfg[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")}, "TOP_K": 8,
             "MUL_ROUTED_WEIGHT": True, "FP32_IEEE": False, "EVEN_K": even_k},
            cfg["num_warps"], cfg["num_stages"]))
    return out


if __name__ == "__main__":
    print(json.dumps([*mla(), *fp8_gemms()]))
