"""What the parallelism tests run inside each spawned rank (module level: ranks import it by name).

`declared_vs_real` builds one rank engine per case and returns, for the test process to compare with what the
plugins declare from shapes: the bytes of every weight tensor the rank holds, and every collective its forward makes
in one extend step (written down on the way to the real gloo group: kind, bytes as `Collective` counts them, global
ranks). Each DP group serves PROMPT_LENS[dp_rank]: uneven token counts, and at size 4 a group with none (IDLE).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.instance.rank_loop import InstanceSpec, build_rank_engine, control_group
from framework.engine.request import Req, SamplingParams

PROMPT_LENS = [[5, 9], [3], [], [7, 2, 4]]


class Recorder:
    """A Group that writes down each forward collective it runs (a gather of no rows is skipped, as Group does)."""

    def __init__(self, group: Group, log: list):
        self.group, self.log = group, log
        self.ranks = tuple(dist.get_process_group_ranks(group.pg))

    def __getattr__(self, name):
        return getattr(self.group, name)

    def all_gather_uneven(self, x, counts):
        if max(counts):
            self.log.append(("all_gather", len(counts) * max(counts) * x.shape[1:].numel() * x.element_size(),
                             self.ranks))
        return self.group.all_gather_uneven(x, counts)

    def reduce_scatter_uneven(self, x, counts):
        if max(counts):
            self.log.append(("reduce_scatter", len(counts) * max(counts) * x.shape[1:].numel() * x.element_size(),
                             self.ranks))
        return self.group.reduce_scatter_uneven(x, counts)

    def all_reduce(self, x, op="sum"):
        self.log.append(("all_reduce", x.numel() * x.element_size(), self.ranks))
        return self.group.all_reduce(x, op)


def rank_weight_bytes(engine) -> int:
    """Bytes of every weight tensor the rank holds: the model's parameters and the MoE backends' expert tensors (the
    floating-point ones: a backend's integer bookkeeping, such as expert loads or a replica placement, is no weight)."""
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    experts = sum(t.numel() * t.element_size() for layer in engine.model.moe_layers()
                  for t in vars(layer.backend).values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    return params + experts


def declared_vs_real(group: Group, cases: dict) -> dict:
    control = control_group(group, 60.0)
    out = {}
    for name, (par_cfg, moe_cfg, model_cfg) in cases.items():
        spec = InstanceSpec(model_cfg, EngineConfig(kv_budget_mb=0.05, device="cpu"), par_cfg, moe_cfg)
        engine = build_rank_engine(spec, group, control)
        par, log = engine.par, []
        for attr, value in list(vars(par).items()):
            if isinstance(value, Group) and value.size > 1 and attr != "control":
                setattr(par, attr, Recorder(value, log))
        for n in PROMPT_LENS[par.dp_rank]:
            engine.add(Req(list(range(10, 10 + n)), SamplingParams(max_new_tokens=2)))
        engine.step()
        out[name] = {"weight_bytes": rank_weight_bytes(engine), "collectives": log}
    return out
