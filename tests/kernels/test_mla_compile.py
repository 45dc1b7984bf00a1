"""Without a GPU, the new kernels compile for Hopper at the settings the GPU check runs them with (the interpreter
never runs Triton's compiler), within the shared memory one block may use."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.long
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real in every test")
def test_mla_and_fp8_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    helper = Path(__file__).with_name("mla_hopper_compile.py")
    proc = subprocess.run([sys.executable, str(helper)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = {c["name"]: c for c in json.loads(proc.stdout)}
    assert set(compiled) == {"mla_decode_stage1", "mla_decode_stage2", "mla_extend", "fp8_gemm_decode",
                             "fp8_gemm_prefill", "fp8_gemm_test"}
    from mla_hopper_compile import H200_SHARED_BYTES
    assert all(c["shared_bytes"] <= H200_SHARED_BYTES for c in compiled.values()), compiled
    # the latent tiles are staged in shared memory (a 32-row bf16 block of 512 columns is 32 KiB)
    assert compiled["mla_decode_stage1"]["shared_bytes"] >= 32 * 512 * 2
