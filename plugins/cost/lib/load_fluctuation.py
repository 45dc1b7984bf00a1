"""Per-batch fluctuation of expert loads around the replayed distribution (issue 21, round 5; docs/fidelity.md,
`sim.cost.expert_load_fluctuation`).

The replayed loads (`sim.cost.expert_loads`) are an accumulated distribution: the long-run average EPLB places its
slots for. One batch's picks scatter around that average, so a placement balanced for it is less balanced in each
batch (and EPLB off too). The lmsys blog of 2025-05-05 says so ("Larger batches reduce random fluctuations in expert
usage"; "Even with EPLB, some imbalance is inevitable") and measures it: its decode case study plots SGLang's
balancedness per decode step with EPLB on (experiments/wide_ep/fit_load_fluctuation.py reads it).

The model: each MoE layer's expert shares in one batch are a Dirichlet draw around the replayed shares p with
concentration picks / inflation, where picks = the tokens routed into the EP group x top-k. Each share then varies
by inflation x p (1 - p) / (picks + inflation), ~`inflation` times what independent picks would give once picks >>
inflation (every priced batch: 9k to 4M picks), and less the larger the batch. Per draw, each rank serves its slots'
experts (an expert's picks split evenly over its replicas, as expert_load.rank_imbalance does); the busiest rank over
the mean is averaged over the draws and the layers. Seeded by (seed, picks): the same step prices the same every time.
Under two-batch overlap each micro-batch is priced at its own picks (half the step's: a larger factor; the step
breakdown's `moe_rank_imbalance` is the whole step's). Each new batch size costs one set of draws (10-50 ms; the last
256 sizes are kept), so the switch is off by default.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

DRAWS = 64          # batches drawn per layer and batch size (58 layers x 64: the mean moves < 0.001 between seeds)


class LoadFluctuation:
    """The busiest rank over the mean, in expectation over per-batch draws, for one placement per layer."""

    def __init__(self, loads: list[list[float]], placements: list, ranks: int, inflation: float, seed: int):
        if inflation <= 0:
            raise ValueError(f"a load fluctuation needs inflation > 0, got {inflation}")
        self.inflation, self.seed = inflation, seed
        shares = np.asarray(loads, dtype=float)
        self.shares = shares / shares.sum(axis=1, keepdims=True)
        self.serve = np.stack([_serving(p, shares.shape[1], ranks) for p in placements])  # [layer, expert, rank]
        self.imbalance = lru_cache(maxsize=256)(self._imbalance)

    def rank_loads(self, picks: int) -> np.ndarray:
        """[layer, draw, rank] shares of one batch's picks (each draw sums to 1 over the ranks)."""
        rng = np.random.default_rng([self.seed, int(picks)])
        alpha = self.shares * (picks / self.inflation)                  # Dirichlet(alpha): gamma draws, normalised
        g = rng.standard_gamma(np.broadcast_to(alpha[:, None, :], (alpha.shape[0], DRAWS, alpha.shape[1])))
        drawn = g / g.sum(axis=2, keepdims=True)
        return np.einsum("lde,ler->ldr", drawn, self.serve)

    def _imbalance(self, picks: int) -> float:
        """Busiest rank's picks over the mean rank's, averaged over draws and layers (the cost model's factor)."""
        r = self.rank_loads(picks) if picks > 0 else np.einsum("le,ler->lr", self.shares, self.serve)[:, None, :]
        return float(np.mean(r.max(axis=2) * r.shape[2]))

    def balancedness(self, picks: int) -> float:
        """Mean rank load over the busiest's, averaged over draws and layers: SGLang's expert-distribution metric
        (compute_utilization_rate), the quantity the blog plots."""
        r = self.rank_loads(picks)
        return float(np.mean(1.0 / (r.max(axis=2) * r.shape[2])))


def _serving(phy2log, experts: int, ranks: int) -> np.ndarray:
    """[expert, rank]: the share of an expert's picks each rank serves (its slots there over the expert's replicas)."""
    per_rank = len(phy2log) // ranks
    slots = np.zeros((experts, ranks))
    for s, e in enumerate(phy2log):
        slots[e, s // per_rank] += 1
    replicas = slots.sum(axis=1, keepdims=True)
    if (replicas == 0).any():
        raise ValueError("a placement must hold every expert at least once")
    return slots / replicas
