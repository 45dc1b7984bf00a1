"""sim/cost=distserve_profile: DistServe's own step-time model (OSDI'24 artifact, simdistserve), fitted by its authors
on single forward passes of OPT-13B on an A100-80GB, with one set of coefficients per serving system.

The profile (`path`, default experiments/pd_repro/distserve_profile_a100.json; its source, commit and license are in
the file) holds, per system (`system`: distserve or vllm) and TP degree, milliseconds as simdistserve prices them
(simdistserve/estimators/time_estimator.py):

- EXTEND: a + b sum(l) + c sum(l^2) over the batch's prompts l. A chunk of n new tokens on a prefix of p (DistServe
  never chunks; servelab's scheduler may cut the last prompt of a batch) counts its share of the quadratic (attention)
  term, (p + n)^2 - p^2, so that a prompt cut in two costs what it costs whole, but one intercept more;
- DECODE: a + b sum(context + 1) + c batch, with the `smallbs` coefficients below the profile's threshold of
  requests and `largebs` from it on;
- no host, front-end or CUDA-graph terms: the profile timed the engines' forward steps as they ran.

Only what was profiled can be priced: another model, GPU, system or TP degree is refused with what is there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from framework.contracts.cost import CostConfig, CostModel, InstanceShape, Step
from framework.core.errors import UserError
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST

DEFAULT_PATH = "experiments/pd_repro/distserve_profile_a100.json"


@dataclass
class DistServeProfileConfig(CostConfig):
    name: str = "distserve_profile"
    system: str = "distserve"          # whose coefficients: distserve | vllm (the artifact profiled each engine)
    path: str = DEFAULT_PATH           # the profile (relative: to the repository)


def load(path: str) -> dict:
    p = REPO_ROOT / path  # an absolute path stays itself
    if not p.exists():
        raise UserError(f"sim.cost.path={path}: no DistServe profile there (the repository ships {DEFAULT_PATH})")
    return json.loads(p.read_text())


@COST.register("distserve_profile")
class DistServeProfileCost(CostModel):
    Config = DistServeProfileConfig

    def __init__(self, cfg: DistServeProfileConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        data = load(cfg.path)
        if instance.model.name != data["model"] or instance.hardware.name != data["hardware"]:
            raise UserError(f"sim.cost=distserve_profile prices model={data['model']} (DistServe's "
                            f"{data['profiled_model']}) on hardware={data['hardware']} only, not "
                            f"model={instance.model.name} on hardware={instance.hardware.name}")
        systems = data["systems"]
        if cfg.system not in systems:
            raise UserError(f"sim.cost.system={cfg.system!r} is not one of {', '.join(systems)}")
        by_tp = systems[cfg.system]
        if str(instance.size) not in by_tp:
            raise UserError(f"sim.cost=distserve_profile has no {cfg.system} profile at {instance.size} GPUs "
                            f"(parallel.size); profiled: {', '.join(sorted(by_tp))}")
        p, ms = by_tp[str(instance.size)], 1e-3
        self._pre = [x * ms for x in p["prefill"]]
        self._small = [x * ms for x in p["decoding_smallbs"]]
        self._large = [x * ms for x in p["decoding_largebs"]]
        self._threshold = p["decoding_large_small_bs_threshold"]
        self._link = None

    def prefill_time(self, new_tokens: tuple[int, ...], prefix: tuple[int, ...]) -> float:
        a, b, c = self._pre
        return a + b * sum(new_tokens) + c * sum((p + n) ** 2 - p * p for n, p in zip(new_tokens, prefix))

    def decode_time(self, batch: int, context: int) -> float:
        """`batch` requests holding `context` tokens of KV in all (each gets one more this step)."""
        a, b, c = self._small if batch < self._threshold else self._large
        return a + b * (context + batch) + c * batch

    def step_time(self, step: Step) -> float:
        t = 0.0
        for bt in step.batches:          # DP groups: the slowest (this profile has TP only: one batch)
            if bt.mode == "idle" or not bt.new_tokens:
                continue
            s = (self.decode_time(len(bt.new_tokens), sum(bt.prefix)) if bt.mode == "decode"
                 else self.prefill_time(bt.new_tokens, bt.prefix))
            t = s if s > t else t
        return t

    def decode_times(self, sizes: tuple[int, ...], contexts: tuple[int, ...], k: int,
                     graph: bool = True, outputs: tuple[int, ...] | None = None) -> list[float]:
        """As step_time prices each of the k steps, without building them (the simulator's hot path)."""
        busy = [(n, c) for n, c in zip(sizes, contexts) if n]
        return [max((self.decode_time(n, c + j * n) for n, c in busy), default=0.0) for j in range(k)]

    def kv_link(self, intra_node: bool) -> tuple[float, float]:
        """The KV transfer as sim.cost=roofline prices it (the fitted point-to-point link): simdistserve prices no
        transfer, and this keeps the link out of what the switch changes."""
        if self._link is None:
            self._link = COST.build("roofline", COST.get("roofline").Config(), self.instance)
        return self._link.kv_link(intra_node)
