"""Vidur's published GPU profiles (data/gpu-profiles/, MIT), read as roofline operations with their measured times.

compute/{gpu}_{model}_mlp.csv.gz: one Llama-2 layer's dense operations at many token counts and TP degrees (fp16).
network/{gpu}_dgx_{collective}.csv.gz: NCCL all_reduce and send_recv by message bytes, ranks and ranks per node.
"""
from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

from framework.core.paths import DATA_DIR

PROFILES = DATA_DIR / "gpu-profiles"
ACT_BYTES = 2                    # Vidur profiles fp16 tensors
GEMM_KINDS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# the profiled elementwise operations -> the fitted kernel kind the roofline prices them with
MEMOP_KINDS = {"input_layernorm": "rmsnorm", "post_attention_layernorm": "rmsnorm", "mlp_act": "act",
               "attn_rope": "rope", "add": "add", "emb": "emb"}


@dataclass(frozen=True)
class GemmOp:
    kind: str
    m: int
    n: int
    k: int
    time_s: float
    model: str       # the profiled model whose layer this is


@dataclass(frozen=True)
class MemOp:
    kind: str        # the profiled operation
    memop: str       # the fitted kernel kind
    nbytes: int
    time_s: float
    model: str


@dataclass(frozen=True)
class CollectiveOp:
    kind: str
    ranks: int
    nbytes: int
    inter_node: bool
    time_s: float


def gpus() -> list[str]:
    return sorted({p.name.split("_")[0] for p in (PROFILES / "compute").glob("*.csv.gz")})


def _rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def compute_ops(gpu: str) -> list[GemmOp | MemOp]:
    """Every profiled operation of every layer row, as the kernel the roofline would price it as."""
    ops: list[GemmOp | MemOp] = []
    for path in sorted((PROFILES / "compute").glob(f"{gpu}_*_mlp.csv.gz")):
        model = path.name.split("_")[1]
        for r in _rows(path):
            h, heads, kv_heads = int(r["n_embd"]), int(r["n_head"]), int(r["n_kv_head"])
            inter, tp, t = int(r["n_expanded_embd"]), int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])
            head_dim, gated = h // heads, r["use_gated_mlp"] == "True"
            up = (2 if gated else 1) * inter // tp
            gemms = {"attn_pre_proj": (t, (heads + 2 * kv_heads) * head_dim // tp, h),   # fused QKV
                     "attn_post_proj": (t, h, heads * head_dim // tp),
                     "mlp_up_proj": (t, up, h), "mlp_down_proj": (t, h, inter // tp)}
            traffic = {"input_layernorm": 2 * t * h, "post_attention_layernorm": 2 * t * h,   # read + write
                       "mlp_act": t * (up + inter // tp), "attn_rope": 2 * t * (heads + kv_heads) * head_dim // tp,
                       "add": 3 * t * h, "emb": 2 * t * h}                                  # rows read + written
            for kind, (m, n, k) in gemms.items():
                ops.append(GemmOp(kind, m, n, k, float(r[f"time_stats.{kind}.median"]) * 1e-3, model))
            for kind, values in traffic.items():
                ops.append(MemOp(kind, MEMOP_KINDS[kind], values * ACT_BYTES,
                                 float(r[f"time_stats.{kind}.median"]) * 1e-3, model))
    return ops


def network_ops(gpu: str) -> list[CollectiveOp]:
    ops = []
    for path in sorted((PROFILES / "network").glob(f"{gpu}_dgx_*.csv.gz")):
        for r in _rows(path):
            kind, ranks = r["collective"], int(r["num_workers"])
            ops.append(CollectiveOp(kind, ranks, int(r["size"]), ranks > int(r["devices_per_node"]),
                                    float(r[f"time_stats.{kind}.median"]) * 1e-3))
    return ops
