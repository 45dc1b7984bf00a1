"""Roofline primitives: the time of one GEMM, elementwise kernel or collective on a GPU given as data.

Every term that a spec sheet does not give (how close a kernel gets to peak, fixed per-kernel and per-collective
latencies) comes from the fit on measured profiles (framework/gpu/fit.py), so each primitive here is checked
against real measurements by experiments/roofline_validation/run.py. Plain floats, no numpy: a simulator calls these
about a million times.
"""
from __future__ import annotations

from framework.gpu.hardware import Fit, HardwareConfig, LinkFit
from framework.gpu.tables import bracket

# Bytes each rank moves over its link per byte of the collective's buffer, over n ranks (nccl-tests' bus
# bandwidth convention): a ring all-reduce is a reduce-scatter then an all-gather, each (n-1)/n of the buffer.
TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}


class Roofline:
    def __init__(self, hw: HardwareConfig, fit: Fit | None = None):
        self.hw = hw
        self.fit = fit if fit is not None else Fit.load(hw.fit)
        g = self.fit.gemm
        self.hbm = hw.hbm_gb_s * 1e9
        self._gemm_lat, self._half_m = g.latency_us * 1e-6, g.half_m
        self._gemm_bw = self.hbm * g.mem_eff
        self._gemm_flops = {}          # dtype -> achieved peak FLOP/s of large GEMMs
        self._memops = {k: (t.latency_us * 1e-6, self.hbm * t.mem_eff) for k, t in self.fit.memops.items()}
        self._links: dict[tuple, tuple[float, float]] = {}   # (kind, ranks, inter_node) -> (latency, s per byte)

    def gemm_flops(self, dtype: str) -> float:
        if dtype not in self._gemm_flops:
            self._gemm_flops[dtype] = self.hw.peak_flops(dtype) * self.fit.gemm.compute_eff
        return self._gemm_flops[dtype]

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0, dtype: str = "bfloat16",
             weight_bytes: float = 2.0, act_bytes: float = 2.0) -> float:
        """`batch` independent [m, k] x [k, n] products (one kernel): the weights [k, n] are read once each."""
        if m <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * batch * m * n * k
        nbytes = batch * (k * n * weight_bytes + m * (k + n) * act_bytes)
        compute = flops * (1.0 + self._half_m / m) / self.gemm_flops(dtype)
        return self._gemm_lat + max(compute, nbytes / self._gemm_bw)

    def attention(self, flops: float, nbytes: float) -> float:
        """An attention kernel. The profiles hold none, so it borrows the GEMM terms of large GEMMs: their compute
        efficiency (no small-m ramp: the kernel's tiles are sized to its head and query blocks, not to a GEMM's
        rows), their memory efficiency and latency. Unvalidated: an assumption the validation cannot check."""
        if flops <= 0:
            return 0.0
        return self._gemm_lat + max(flops / self.gemm_flops("bfloat16"), nbytes / self._gemm_bw)

    def memop(self, kind: str, nbytes: float) -> float:
        """An elementwise kernel of a fitted kind (rmsnorm, act, rope, add, emb) moving `nbytes` through HBM."""
        if nbytes <= 0:
            return 0.0
        latency, bw = self._memops[kind]
        return latency + nbytes / bw

    def collective(self, kind: str, nbytes: float, ranks: int, inter_node: bool | None = None) -> float:
        """`nbytes`: the buffer one rank holds, as nccl-tests sizes it (all_gather: the gathered output,
        reduce_scatter: the input, all_to_all: everything one rank sends). Spans nodes when `ranks` exceeds
        hardware.gpus_per_node unless `inter_node` says otherwise."""
        if kind not in TRAFFIC:
            raise ValueError(f"unknown collective {kind!r}; known: {', '.join(TRAFFIC)}")
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if inter_node is None:
            inter_node = ranks > self.hw.gpus_per_node
        key = (kind, ranks, inter_node)
        if key not in self._links:
            terms = self._link_terms(kind, ranks, inter_node)
            link = self.hw.inter_node_gb_s if inter_node else self.hw.nvlink_gb_s
            self._links[key] = (terms.latency_us * 1e-6, TRAFFIC[kind](ranks) / (link * 1e9 * terms.bus_eff))
        latency, seconds_per_byte = self._links[key]
        return latency + nbytes * seconds_per_byte

    def _link_terms(self, kind: str, ranks: int, inter_node: bool) -> LinkFit:
        """The profiles hold all_reduce and send_recv: all-gather, reduce-scatter and all-to-all move their data as
        the halves of a ring all-reduce do, so they take its terms (latency included: conservative)."""
        table = self.fit.inter_node if inter_node else self.fit.intra_node
        for candidate in (kind,) if kind == "send_recv" else (kind, "all_reduce", "send_recv"):
            if candidate in table:
                return _interpolate(table[candidate], ranks)
        raise ValueError(f"fitted terms {self.fit.gpu!r} have no {'inter' if inter_node else 'intra'}-node "
                         f"collective to price {kind} with")


def _interpolate(by_ranks: dict[int, LinkFit], ranks: int) -> LinkFit:
    """Linear in the rank count between profiled counts; the nearest profiled count outside them."""
    lo, hi, w = bracket(by_ranks, ranks)
    if lo == hi:
        return by_ranks[lo]
    a, b = by_ranks[lo], by_ranks[hi]
    return LinkFit(a.latency_us + w * (b.latency_us - a.latency_us), a.bus_eff + w * (b.bus_eff - a.bus_eff))
