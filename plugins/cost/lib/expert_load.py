"""Expert-load skew for the cost model (issue 21, item 4): where a MoE layer's (token, expert) pairs go, and how
far the busiest rank of expert parallelism is above the mean under a placement of physical expert slots.

- loads: `uniform` (every expert alike: the mean), `zipf` (expert popularity proportional to 1 / rank^s, a seeded
  random order of experts per layer; no expert can take more than one pick per token, so a share above 1/k spills
  over to the others), or a JSON file of recorded loads (framework/model/moe_stats.py's results key `expert_load`,
  {"layer<i>": counts}, or a plain list of per-layer lists);
- placement: physical slot s holds logical expert phy2log[s], rank r holds slots [r P/n, (r+1) P/n); an expert's
  pairs split evenly over its replicas (SGLang 2025 dispatches to replicas at random: the expectation);
- EPLB: `rebalance` places P slots for the loads with deepseek-ai/EPLB's global policy (replicate_experts +
  balanced_packing), the same code the MoE backend places its experts with (framework/contracts/eplb.py).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from framework.contracts.eplb import Policy
from framework.contracts.eplb import rebalance as eplb_rebalance
from framework.core.errors import UserError
from framework.core.paths import REPO_ROOT

SOURCES = ("uniform", "zipf")


def expected_touched(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts `tokens` tokens pick, in expectation under uniform routing: a token misses a given expert
    with probability 1 - k/E."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def zipf_shares(experts: int, top_k: int, exponent: float, rng: random.Random) -> list[float]:
    """Each expert's share of a layer's picks (sums to 1), capped at 1/top_k (a token picks an expert once)."""
    weights = [1.0 / (i + 1) ** exponent for i in range(experts)]
    rng.shuffle(weights)
    cap, shares, fixed = 1.0 / top_k, [0.0] * experts, set()
    while True:                                      # water-fill: cap the heaviest, spread the rest in proportion
        free = [e for e in range(experts) if e not in fixed]
        room = 1.0 - cap * len(fixed)
        total = sum(weights[e] for e in free)
        over = [e for e in free if weights[e] / total * room > cap]
        if not over:
            for e in free:
                shares[e] = weights[e] / total * room
            for e in fixed:
                shares[e] = cap
            return shares
        fixed.update(over)


def read_loads(path: str, experts: int) -> list[list[float]]:
    """Per-layer expert loads from a recorded run's JSON (see the module docstring)."""
    p = Path(path)
    p = p if p.is_absolute() else REPO_ROOT / p
    if not p.is_file():
        raise UserError(f"sim.cost.expert_loads={path!r}: no such file (uniform | zipf | a JSON of recorded loads)")
    data = json.loads(p.read_text())
    if isinstance(data, dict):
        data = data.get("expert_load", data)
        data = [data[k] for k in sorted(data, key=lambda k: int(str(k).removeprefix("layer")))]
    if not data or any(len(row) != experts for row in data):
        raise UserError(f"sim.cost.expert_loads={path!r}: every layer needs {experts} expert loads (the model's "
                        f"n_routed_experts); got layers of {sorted({len(r) for r in data})}")
    return [[float(x) for x in row] for row in data]


def layer_loads(source: str, experts: int, top_k: int, layers: int, exponent: float,
                seed: int) -> list[list[float]] | None:
    """Per-layer expert shares; None for uniform (every rank at the mean)."""
    if source == "uniform":
        return None
    if source == "zipf":
        if exponent < 0:
            raise UserError(f"sim.cost.zipf_exponent={exponent} must be >= 0")
        return [zipf_shares(experts, top_k, exponent, random.Random(seed * 1_000_003 + layer))
                for layer in range(layers)]
    return read_loads(source, experts)


def rank_imbalance(loads: list[float], phy2log: tuple[int, ...] | list[int], ranks: int) -> float:
    """Busiest rank's pairs over the mean rank's, with each expert's load split evenly over its replicas."""
    replicas = [0] * len(loads)
    for e in phy2log:
        replicas[e] += 1
    if any(r == 0 for r in replicas):
        raise ValueError("a placement must hold every expert at least once")
    per_rank = len(phy2log) // ranks
    rank_load = [sum(loads[phy2log[s]] / replicas[phy2log[s]] for s in range(r * per_rank, (r + 1) * per_rank))
                 for r in range(ranks)]
    mean = sum(rank_load) / ranks
    return max(rank_load) / mean if mean > 0 else 1.0


def rebalance(loads: list[float], num_physical: int, ranks: int) -> list[int]:
    """phy2log for `num_physical` slots on `ranks` ranks, balanced for `loads` (EPLB's global policy; ties: the
    lower expert, the lower rank)."""
    experts = len(loads)
    if num_physical < experts or num_physical % ranks:
        raise ValueError(f"{num_physical} slots must hold {experts} experts and divide over {ranks} ranks")
    return eplb_rebalance(loads, num_physical, 1, 1, ranks, Policy["global"])
