"""KV tokens per instance under DP attention and TP with SGLang's memory sizing, computed from shapes alone (no
model is built): each rank's static budget (weights + KV) less the weights its parallelism and MoE plugins declare,
divided by the KV bytes of one token. Prints the table and writes kv_sizing.json beside this file.

    python experiments/dp_attn_vs_tp/kv_sizing.py

Rows: the default tiny model at the experiment's budget (config.yaml, mem_budget) and DeepSeek-V2 (bf16, 8 ranks)
on H200s and H100s with SGLang v0.4's mem_fraction_static for 8 ranks (0.81 of the GPU's memory).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.config import compose  # noqa: E402
from framework.engine.engine import plan_memory  # noqa: E402
from framework.model.config import ModelConfig  # noqa: E402
from framework.core.registry import MOE, PARALLELISM  # noqa: E402

SCHEMES = ("tp", "dp_attn", "dp_attn_tp")
MEM_FRACTION_STATIC_8 = 0.81        # SGLang v0.4 server_args for tp_size 8


def sizing(model: ModelConfig, budget_mb: float, size: int, moe: str) -> dict:
    out = {}
    for scheme in SCHEMES:
        cfg = compose(["logger.mode=disabled", f"parallel={scheme}", f"parallel.size={size}", f"moe={moe}",
                       f"engine.mem_budget_mb={budget_mb}"])
        plugin = PARALLELISM.get(scheme)
        try:
            plan = plan_memory(model, cfg.engine, plugin, cfg.parallel, MOE.get(moe), cfg.moe)
        except ValueError:
            out[scheme] = {"fits": False}
            continue
        out[scheme] = {"fits": True, "weight_bytes_per_rank": plan.weight_bytes_total,
                       "kv_capacity_tokens_per_rank": plan.kv_tokens,
                       "kv_capacity_tokens_instance": plan.kv_tokens * plugin.dp_size(cfg.parallel)}
    return out


def main() -> None:
    tiny_budget = float(next(o for o in OmegaConf.load(HERE / "config.yaml").sizings.mem_budget).split("=")[1])
    v2 = ModelConfig(**OmegaConf.to_container(OmegaConf.load(HERE / "deepseek_v2.yaml")))
    rows = [("tiny_mla_moe", f"{tiny_budget} MB", size, moe, sizing(ModelConfig(), tiny_budget, size, moe))
            for size in (2, 4, 8) for moe in ("triton_fused", "ep")]
    for gpu, gb in (("H200", 141), ("H100", 80)):
        budget = MEM_FRACTION_STATIC_8 * gb * 1e9 / 2**20
        rows += [("deepseek_v2", f"{gpu} x0.81", 8, moe, sizing(v2, budget, 8, moe)) for moe in ("triton_fused", "ep")]
    print(f"{'model':>13} {'budget/rank':>12} {'size':>4} {'moe':>12} " + " ".join(
        f"{s + ' MiB/rank':>20} {s + ' KV tok/inst':>22}" for s in SCHEMES) + f" {'dp_attn/tp':>10}")
    for model, budget, size, moe, res in rows:
        cells = " ".join(f"{r['weight_bytes_per_rank'] / 2**20:>20,.3f} {r['kv_capacity_tokens_instance']:>22,}"
                         if r["fits"] else f"{'weights > budget':>43}" for r in res.values())
        fits = res["tp"]["fits"] and res["dp_attn"]["fits"]
        ratio = res["dp_attn"]["kv_capacity_tokens_instance"] / res["tp"]["kv_capacity_tokens_instance"] if fits else 0
        print(f"{model:>13} {budget:>12} {size:>4} {moe:>12} {cells} " + (f"{ratio:>9.2f}x" if fits else f"{'-':>10}"))
    out = HERE / "kv_sizing.json"
    out.write_text(json.dumps([{"model": m, "budget_per_rank": b, "size": s, "moe": moe, **{
        f"{scheme}_{k}": v for scheme, r in res.items() for k, v in r.items()}} for m, b, s, moe, res in rows],
        indent=2) + "\n")
    print(f"results: {out}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
