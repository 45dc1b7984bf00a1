"""What each rank runs in experiments/eplb/run.py (a module of its own: spawned ranks import it by name).

The real MoE layers of the tiny model (its gate, moe=ep's all-to-all over gloo) on random tokens, with the router
skewed by DeepSeek-V3's correction bias: expert e's selection score gets + skew * (1 - e / E), so low ids, which
moe=ep's contiguous placement puts on rank 0, run hot. Each rank counts the (token, expert) pairs it computes.
"""
from __future__ import annotations

import statistics
import time

import torch

from framework.core.registry import MOE
from framework.model.config import ModelConfig
from framework.model.model import build_model

MODEL = dict(n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=4, gating="v3", num_layers=2,
             first_k_dense_replace=1, moe_intermediate_size=64)


def skewed_layers(skew: float, seed: int = 0):
    model = build_model(ModelConfig(**MODEL), seed=seed)
    layers = model.moe_layers()
    e = layers[0].cfg.n_routed_experts
    for layer in layers:
        layer.correction_bias.data = skew * (1 - torch.arange(e, dtype=torch.float32) / e)
    return model, layers


def run_rank(group, moe_cfg, skew: float, tokens: int, warmup: int, steps: int) -> dict:
    """`warmup` steps record loads, then `steps` measured steps (with moe.eplb.rebalance_every = warmup, EPLB
    re-places the experts at the end of the warmup and every `warmup` steps after, from the loads since the last). Returns this rank's pairs computed and step times over the measured steps."""
    torch.set_num_threads(1)
    _, layers = skewed_layers(skew)
    for layer in layers:
        layer.backend = MOE.build(moe_cfg.name, moe_cfg, layer.w13, layer.w2, group)
    gen = torch.Generator().manual_seed(1000 + group.rank)
    times, start = [], None
    for step in range(warmup + steps):
        x = torch.randn(tokens, layers[0].cfg.hidden_size, generator=gen)
        if step == warmup:
            start = [int(layer.backend.slots_computed) for layer in layers]
        t0 = time.perf_counter()
        for layer in layers:
            layer(x)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    b = layers[0].backend
    return {"pairs": sum(int(layer.backend.slots_computed) - s for layer, s in zip(layers, start)),
            "step_ms_median": 1000 * statistics.median(times),
            "rebalances": sum(layer.backend.stats["eplb_rebalances"] for layer in layers),
            "experts_moved": sum(layer.backend.stats["eplb_experts_moved"] for layer in layers),
            "bytes_moved": sum(layer.backend.stats["eplb_bytes_moved"] for layer in layers),
            "placement_layer1": list(b.placement.phy2log)}
