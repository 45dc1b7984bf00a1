"""parallel=single: the whole model on one rank, nothing split (the quick start's default). The base class is
exactly this behaviour; the plugin only refuses a size other than 1."""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.parallel import Parallelism, ParallelConfig
from framework.core.registry import PARALLELISM


@dataclass
class SingleConfig(ParallelConfig):
    name: str = "single"


@PARALLELISM.register("single")
class Single(Parallelism):
    Config = SingleConfig

    @classmethod
    def check_fits(cls, cfg, model_cfg, moe_partial: bool) -> list[str]:
        if cfg.size != 1:
            return [f"parallel=single runs one rank; for parallel.size={cfg.size} pick parallel=tp, dp_attn or "
                    "dp_attn_tp"]
        return []
