"""sim/cost=splitwise_profile: Splitwise's own step-time model (ISCA'24; its simulator, Mutinifni/splitwise-sim),
priced from the profile its authors measured on DGX-A100 and DGX-H100 machines: data/splitwise/perf_model.csv.gz
(splitwise-sim data/perf_model.csv, copied unchanged; source and license in data/splitwise/README.md).

As splitwise-sim's DatabasePerformanceModel (performance_model.py, init_predictor and get_iteration_duration) prices
an iteration, for the profile's rows of one (model, hardware, tensor_parallel):

- each row's batch tokens are prompt_size x batch_size; per distinct count, the median of its rows' prompt_time and
  of its token_time (ms); between and beyond those counts, straight lines through the nearest two (scipy's
  interp1d(kind="linear", fill_value="extrapolate"));
- a step of prompts (EXTEND) costs prompt_time at the batch's new tokens (Splitwise prefills whole prompts and caches
  no prefix, so its count is the prompts' sizes; here a chunk or a cached prefix counts only what the step computes);
- a step of decodes (DECODE) costs token_time at its number of requests (one token each): the context held is not
  priced, as in Splitwise (its iterations are priced by batch tokens alone);
- Splitwise's mixed iteration (prompts and decodes in one step, prompt_time x 1.1) has no counterpart: servelab's
  scheduler (SGLang v0.4's) runs EXTEND and DECODE steps apart;
- the KV transfer goes at `transfer_gib_s` per instance pair (MixedPoolScheduler's transfer_bandwidth, 200, which
  scheduler.py turns into bytes/s with x 1024**3, on a DummyLink: no latency), split evenly over the instance's GPUs;
  where Splitwise gives every transfer its own link, framework/sim/pd.py shares an instance's links between the
  transfers running on it (experiments/README.md, pd_splitwise).

Each instance is priced on its own hardware's rows, as performance_model.py prices an instance on its processors'
name: a role on other hardware than the run's (framework/runs/sim.py build's role_cfgs: Splitwise-HA's DGX-H100 prompt
machines beside DGX-A100 token machines) gets a cost model of its own. Only what was profiled can be priced: another
model, GPU or TP degree is refused with what is there.
"""
from __future__ import annotations

import csv
import gzip
import statistics
from dataclasses import dataclass

from framework.contracts.cost import CostConfig, CostModel, InstanceShape, Step
from framework.core.errors import UserError
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.gpu.tables import segment

DEFAULT_PATH = "data/splitwise/perf_model.csv.gz"
# servelab's model and hardware keys -> the profile's names (what each stands for: conf/model/bloom176b_mla.yaml)
MODELS = {"bloom176b_mla": "bloom-176b"}
HARDWARE = {"a100_80g": "a100-80gb", "h100_sxm": "h100-80gb"}


@dataclass
class SplitwiseProfileConfig(CostConfig):
    name: str = "splitwise_profile"
    path: str = DEFAULT_PATH           # the profile (relative: to the repository)
    transfer_gib_s: float = 200.0      # KV transfer per instance pair, GiB/s (splitwise-sim mixed_pool.yml)


def read_rows(path: str) -> list[dict]:
    p = REPO_ROOT / path  # an absolute path stays itself
    if not p.exists():
        raise UserError(f"sim.cost.path={path}: no Splitwise profile there (the repository ships {DEFAULT_PATH})")
    with (gzip.open(p, "rt") if p.suffix == ".gz" else open(p)) as f:
        return list(csv.DictReader(f))


class Curve:
    """Seconds against batch tokens: the medians per count, joined by straight lines, the end ones extended."""

    def __init__(self, points: dict[int, list[float]]) -> None:
        self.x = sorted(points)
        self.y = [statistics.median(points[x]) for x in self.x]
        if len(self.x) < 2:
            raise UserError(f"a Splitwise profile curve needs two batch-token counts, got {self.x}")

    def __call__(self, tokens: float) -> float:
        i, w = segment(self.x, tokens, extend=True)
        return self.y[i] + w * (self.y[i + 1] - self.y[i])


def curves(rows: list[dict], model: str, hardware: str, tp: int) -> tuple[Curve, Curve]:
    """The prompt and token curves (seconds) of one (model, hardware, tensor_parallel) of the profile."""
    prompt, token = {}, {}
    for r in rows:
        if r["model"] == model and r["hardware"] == hardware and int(r["tensor_parallel"]) == tp:
            n = int(r["prompt_size"]) * int(r["batch_size"])
            prompt.setdefault(n, []).append(float(r["prompt_time"]) / 1000)
            token.setdefault(n, []).append(float(r["token_time"]) / 1000)
    if not prompt:
        have = sorted({(r["model"], r["hardware"], int(r["tensor_parallel"])) for r in rows})
        raise UserError(f"sim.cost=splitwise_profile has no rows for {model} on {hardware} at TP {tp}; profiled: "
                        + ", ".join(f"{m}/{h}/TP{t}" for m, h, t in have))
    return Curve(prompt), Curve(token)


@COST.register("splitwise_profile")
class SplitwiseProfileCost(CostModel):
    Config = SplitwiseProfileConfig

    def __init__(self, cfg: SplitwiseProfileConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        model, hw = MODELS.get(instance.model.name), HARDWARE.get(instance.hardware.name)
        if model is None or hw is None:
            raise UserError(f"sim.cost=splitwise_profile prices model={'|'.join(MODELS)} on "
                            f"hardware={'|'.join(HARDWARE)} only (Splitwise's profiled models and DGX machines), "
                            f"not model={instance.model.name} on hardware={instance.hardware.name}")
        if cfg.transfer_gib_s <= 0:
            raise UserError(f"sim.cost.transfer_gib_s must be > 0, got {cfg.transfer_gib_s}")
        self.prompt, self.token = curves(read_rows(cfg.path), model, hw, int(instance.size))

    def step_time(self, step: Step) -> float:
        t = 0.0
        for bt in step.batches:          # DP groups: the slowest (Splitwise's instances are TP only: one batch)
            if bt.mode == "idle" or not bt.new_tokens:
                continue
            s = self.token(len(bt.new_tokens)) if bt.mode == "decode" else self.prompt(sum(bt.new_tokens))
            t = s if s > t else t
        return t

    def decode_times(self, sizes: tuple[int, ...], contexts: tuple[int, ...], k: int,
                     graph: bool = True, outputs: tuple[int, ...] | None = None) -> list[float]:
        """As step_time prices each of the k steps: the context does not move the price, so all are equal."""
        return [max((self.token(n) for n in sizes if n), default=0.0)] * k

    def kv_link(self, intra_node: bool) -> tuple[float, float]:
        """One GPU's share of Splitwise's per-pair transfer bandwidth (NVLink or not: splitwise-sim's DummyLink is
        one figure), no latency."""
        return self.cfg.transfer_gib_s * 2**30 / max(int(self.instance.size), 1), 0.0
