"""A GPU as data: spec-sheet peaks (conf/hardware/*.yaml) and the efficiency terms fitted on measured profiles
(data/gpu-profiles/fit/*.json, written by experiments/roofline_validation/run.py)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from framework.core.paths import DATA_DIR

FIT_DIR = DATA_DIR / "gpu-profiles" / "fit"


@dataclass
class HardwareConfig:
    name: str = "h100_sxm"
    bf16_tflops: float = 989.4        # peak dense (no sparsity)
    fp8_tflops: float = 1978.9        # peak dense; 0: the GPU has no fp8 tensor cores
    hbm_gb_s: float = 3350.0
    hbm_gb: float = 80.0
    nvlink_gb_s: float = 450.0        # per GPU, one direction (the bus bandwidth NCCL can reach)
    inter_node_gb_s: float = 50.0     # per GPU, one direction (its NIC)
    gpus_per_node: int = 8
    launch_overhead_us: float = 5.0   # host time to launch one kernel eagerly; a CUDA graph replay pays none
    sm_count: int = 132               # streaming multiprocessors (H100/H200 SXM: 132); what DeepEP's normal kernels
                                      # hold under two-batch overlap is taken from these
    fit: str = "h100"                 # the fitted terms: data/gpu-profiles/fit/<fit>.json

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of the tensor cores for GEMM inputs of `dtype`."""
        tflops = {"bfloat16": self.bf16_tflops, "float16": self.bf16_tflops,
                  "float32": self.bf16_tflops / 2,         # TF32 runs at half the bf16 rate (A100, H100, B200)
                  "fp8": self.fp8_tflops}.get(dtype)
        if tflops is None:
            raise ValueError(f"no peak FLOP/s for dtype {dtype!r}; known: bfloat16, float16, float32, fp8")
        if tflops <= 0:
            raise ValueError(f"hardware {self.name} has no {dtype} tensor cores (hardware.fp8_tflops=0)")
        return tflops * 1e12


@dataclass
class GemmFit:
    """GEMM time = latency + max(FLOPs / (peak * compute_eff * m / (m + half_m)), bytes / (HBM * mem_eff))."""
    latency_us: float
    compute_eff: float     # fraction of peak reached by large GEMMs
    half_m: float          # rows (tokens) at which a GEMM reaches half of compute_eff
    mem_eff: float         # fraction of HBM bandwidth reached by memory-bound GEMMs


@dataclass
class MemOpFit:
    """Elementwise kernel time = latency + bytes / (HBM * mem_eff)."""
    latency_us: float
    mem_eff: float


@dataclass
class LinkFit:
    """Collective time = latency + algorithm bytes / (link bandwidth * bus_eff) (nccl-tests' bus bandwidth)."""
    latency_us: float
    bus_eff: float


@dataclass
class Fit:
    gpu: str
    gemm: GemmFit
    memops: dict[str, MemOpFit]                    # rmsnorm, act, rope, add, emb
    intra_node: dict[str, dict[int, LinkFit]]      # collective -> ranks -> terms (NVLink)
    inter_node: dict[str, dict[int, LinkFit]]      # collective -> ranks -> terms (across nodes: NICs)
    source: str = field(default="")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Fit":
        return cls(gpu=d["gpu"], gemm=GemmFit(**d["gemm"]),
                   memops={k: MemOpFit(**v) for k, v in d["memops"].items()},
                   intra_node=_links(d["intra_node"]), inter_node=_links(d["inter_node"]), source=d.get("source", ""))

    @classmethod
    def load(cls, name: str) -> "Fit":
        path = FIT_DIR / f"{name}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in FIT_DIR.glob("*.json")))
            raise ValueError(f"hardware.fit={name!r}: no fitted terms at {path}; known: {known}")
        return cls.from_dict(json.loads(path.read_text()))


def _links(table: dict) -> dict[str, dict[int, LinkFit]]:
    return {kind: {int(n): LinkFit(**t) for n, t in by_ranks.items()} for kind, by_ranks in table.items()}
