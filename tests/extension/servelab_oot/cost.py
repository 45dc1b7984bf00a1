"""sim.cost=constant_step: every step that computes anything takes `step_s` seconds, whatever its batch (IDLE: 0).
The crudest cost model, and an exact one to check a simulator against: TTFT, TPOT and E2E are whole steps."""
from __future__ import annotations

from dataclasses import dataclass

from framework.contracts.cost import CostConfig, CostModel, InstanceShape, Step
from framework.core.registry import COST


@dataclass
class ConstantStepConfig(CostConfig):
    name: str = "constant_step"
    step_s: float = 0.01


@COST.register("constant_step")
class ConstantStep(CostModel):
    Config = ConstantStepConfig
    cuda_graphs = False          # a replayed graph would cost the same: no reason to model one
    reads_hardware = False       # prices no GPU: `hardware=` would change nothing, so a run that sets it is refused

    def __init__(self, cfg: ConstantStepConfig, instance: InstanceShape) -> None:
        if cfg.step_s <= 0:
            raise ValueError(f"sim.cost.step_s must be > 0, got {cfg.step_s}")
        super().__init__(cfg, instance)

    def step_time(self, step: Step) -> float:
        busy = any(b.mode != "idle" and b.new_tokens for b in step.batches)
        return self.cfg.step_s if busy else 0.0
