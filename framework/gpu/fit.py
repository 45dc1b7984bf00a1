"""Fit the roofline's efficiency terms on measured profiles, and predict each profiled operation with them.

Every fit is a least-squares fit of relative error (each measurement weighs the same whatever its size), linear in
the unknowns, so it is exact and reproducible: no optimiser, no starting point. GEMMs are either compute- or
memory-bound; the fit alternates between assigning each measurement to the bound the current terms predict and
solving the linear fit, until no assignment changes.
"""
from __future__ import annotations

import numpy as np

from framework.gpu.hardware import Fit, GemmFit, HardwareConfig, LinkFit, MemOpFit
from framework.gpu.profiles import ACT_BYTES, CollectiveOp, GemmOp, MemOp, compute_ops, network_ops
from framework.gpu.roofline import TRAFFIC, Roofline

PROFILED_HARDWARE = {"h100": "h100_sxm", "a100": "a100_80g"}   # the GPU each profile set was measured on
SOURCE = "fitted by experiments/roofline_validation/run.py on data/gpu-profiles (Vidur's profiles, MIT)"


def _relative_lstsq(columns: list[np.ndarray], t: np.ndarray) -> np.ndarray:
    """c minimising sum(((columns @ c) / t - 1) ** 2)."""
    x = np.stack(columns, axis=1) / t[:, None]
    return np.linalg.lstsq(x, np.ones_like(t), rcond=None)[0]


def fit_gemm(ops: list[GemmOp], hw: HardwareConfig) -> GemmFit:
    m, n, k, t = (np.array([getattr(o, f) for o in ops], dtype=float) for f in ("m", "n", "k", "time_s"))
    flops, nbytes = 2 * m * n * k, ACT_BYTES * (k * n + m * (k + n))
    compute_bound = m >= 256
    for _ in range(100):
        # time = latency + flops * u + flops / m * v (compute-bound) or latency + bytes * w (memory-bound)
        columns = [np.ones_like(t), np.where(compute_bound, flops, 0.0), np.where(compute_bound, flops / m, 0.0),
                   np.where(compute_bound, 0.0, nbytes)]
        lat, u, v, w = _relative_lstsq(columns, t)
        now = flops * u + flops / m * v > nbytes * w
        if (now == compute_bound).all():
            break
        compute_bound = now
    return GemmFit(latency_us=float(lat * 1e6), compute_eff=float(1 / (u * hw.peak_flops("float16"))),
                   half_m=float(v / u), mem_eff=float(1 / (w * hw.hbm_gb_s * 1e9)))


def fit_memops(ops: list[MemOp], hw: HardwareConfig) -> dict[str, MemOpFit]:
    fits = {}
    for kind in sorted({o.memop for o in ops}):
        sel = [o for o in ops if o.memop == kind]
        t = np.array([o.time_s for o in sel])
        lat, w = _relative_lstsq([np.ones_like(t), np.array([o.nbytes for o in sel], dtype=float)], t)
        fits[kind] = MemOpFit(latency_us=float(lat * 1e6), mem_eff=float(1 / (w * hw.hbm_gb_s * 1e9)))
    return fits


def _fit_link(ops: list[CollectiveOp], link_gb_s: float) -> LinkFit:
    t = np.array([o.time_s for o in ops])
    traffic = np.array([TRAFFIC[o.kind](o.ranks) * o.nbytes for o in ops])
    lat, w = _relative_lstsq([np.ones_like(t), traffic], t)
    return LinkFit(latency_us=float(lat * 1e6), bus_eff=float(1 / (w * link_gb_s * 1e9)))


def fit_links(ops: list[CollectiveOp], hw: HardwareConfig):
    """Terms per collective and rank count, within a node (NVLink) and across nodes (NICs)."""
    tables: tuple[dict, dict] = ({}, {})
    for inter_node, table in enumerate(tables):
        link = hw.inter_node_gb_s if inter_node else hw.nvlink_gb_s
        sel = [o for o in ops if o.inter_node == bool(inter_node)]
        for kind, ranks in sorted({(o.kind, o.ranks) for o in sel}):
            table.setdefault(kind, {})[ranks] = _fit_link([o for o in sel if (o.kind, o.ranks) == (kind, ranks)], link)
    return tables


def fit(gpu: str, hw: HardwareConfig) -> Fit:
    compute = compute_ops(gpu)
    intra, inter = fit_links(network_ops(gpu), hw)
    return Fit(gpu=gpu, gemm=fit_gemm([o for o in compute if isinstance(o, GemmOp)], hw),
               memops=fit_memops([o for o in compute if isinstance(o, MemOp)], hw),
               intra_node=intra, inter_node=inter, source=SOURCE)


def predict(roofline: Roofline, op: GemmOp | MemOp | CollectiveOp) -> float:
    """The roofline's time for a profiled operation, priced exactly as the cost model prices its own kernels."""
    if isinstance(op, GemmOp):
        return roofline.gemm(op.m, op.n, op.k, dtype="float16", weight_bytes=ACT_BYTES, act_bytes=ACT_BYTES)
    if isinstance(op, MemOp):
        return roofline.memop(op.memop, op.nbytes)
    return roofline.collective(op.kind, op.nbytes, op.ranks, inter_node=op.inter_node)
