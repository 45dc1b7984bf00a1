"""What a simulator asks a cost model (a `sim/cost=` plugin, plugins/cost/): how long one engine step of one
instance takes. Built once per instance with what does not change (`InstanceShape`), then asked per step (`Step`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from framework.model.config import ModelConfig
from framework.gpu.hardware import HardwareConfig

if TYPE_CHECKING:                      # (batch.py imports torch; this contract does not need it at run time)
    from framework.contracts.batch import ForwardBatch

MODES = ("extend", "decode", "idle")


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name (a ModelConfig.dtype)."""
    import torch
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


@dataclass
class CostConfig:
    name: str = ""          # the plugin's key: each plugin's Config names itself


@dataclass(frozen=True)
class Collective:
    """One collective a step makes `count` times (e.g. once per layer), as a parallelism or MoE plugin declares it.
    `nbytes`: the buffer one rank holds, as nccl-tests sizes it: all_reduce the tensor, all_gather the gathered
    output, reduce_scatter the input, all_to_all everything the busiest rank sends (its own share included)."""
    kind: str                 # all_gather | all_reduce | reduce_scatter | all_to_all | send_recv
    nbytes: int
    ranks: int
    count: int = 1


@dataclass(frozen=True)
class BatchShape:
    """One scheduler's batch in a step (TP: the instance's one batch; DP attention: one per rank)."""
    mode: str = "idle"                        # extend | decode | idle
    new_tokens: tuple[int, ...] = ()          # per request: tokens computed this step (decode: 1 each)
    prefix: tuple[int, ...] = ()              # per request: tokens already in its KV (cached prefix + context)
    outputs: int = 0                          # DECODE: the tokens its requests have generated so far, in all
                                              # (SGLang streams each request's whole output every step); filled
                                              # for a cost model that reads them (CostModel.reads_outputs)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batch mode {self.mode!r} is not one of {', '.join(MODES)}")
        if len(self.new_tokens) != len(self.prefix):
            raise ValueError(f"a batch needs one prefix length per request: {len(self.new_tokens)} requests, "
                             f"{len(self.prefix)} prefix lengths")
        if self.outputs < 0 or (self.outputs and self.mode != "decode"):
            raise ValueError(f"outputs={self.outputs}: a DECODE batch's generated tokens (>= 0); a {self.mode} "
                             f"batch has none")


@dataclass(frozen=True)
class Step:
    batches: tuple[BatchShape, ...]            # one per scheduler of the instance
    graph: bool = False                        # replays a captured CUDA graph (no per-kernel launch cost)
    collectives: tuple[Collective, ...] | None = None   # the plugins' declarations; None: the cost model's own


@dataclass(frozen=True)
class InstanceShape:
    """What an engine instance runs on and how it is split: fixed for the instance's life."""
    model: ModelConfig
    hardware: HardwareConfig
    parallel: str                              # the parallelism plugin's key (parallel.name)
    size: int                                  # GPUs of the instance (parallel.size)
    moe: str                                   # the MoE backend's key (moe.name)
    parallel_cfg: Any = None                   # the plugins' own configs (their other fields: moe.dispatch,
    moe_cfg: Any = None                        # parallel.tp_size...); None: the plugin's defaults at `size`


class CostModel(ABC):
    """A `sim/cost=` plugin: `Config` is its schema, `step_time` its one question."""

    Config = CostConfig
    cuda_graphs = True          # the priced hardware replays captured decode graphs (engine.cuda_graph); a CPU: no
    reads_hardware = True       # prices the GPU `hardware=` names; False: what it measured, wherever it ran
    reads_outputs = False       # prices a DECODE batch's generated tokens (BatchShape.outputs); False: the
                                # simulator leaves them 0 (summing them is a pass over the batch every step)

    def __init__(self, cfg, instance: InstanceShape) -> None:
        self.cfg, self.instance = cfg, instance

    def describe(self) -> dict[str, Any]:
        """What results.json says about the cost model: its key, its config, and the hardware its times are for."""
        return {"sim_cost_model": self.cfg.name, "sim_cost_config": asdict(self.cfg),
                "sim_hardware": self.instance.hardware.name if self.reads_hardware else "this host"}

    @abstractmethod
    def step_time(self, step: Step) -> float:
        """Seconds from the start of the step's forward on every rank to its last rank's logits."""

    def decode_times(self, sizes: tuple[int, ...], contexts: tuple[int, ...], k: int,
                     graph: bool = True, outputs: tuple[int, ...] | None = None) -> list[float]:
        """The next k DECODE steps of a run (a simulator advances runs in one event): in step j (from 0) scheduler
        g has sizes[g] requests holding contexts[g] + j x sizes[g] tokens of KV before it (0 requests: IDLE) and
        having generated outputs[g] + j x sizes[g] tokens (None: 0), each batch in the canonical shape (its whole
        context on its first request: decode is priced by batch size and total context; `graph`: whether they
        replay a CUDA graph). A model may override this with a faster equal computation."""
        outputs = outputs or (0,) * len(sizes)
        return [self.step_time(Step(tuple(decode_shape(n, c + j * n, o + j * n) if n else BatchShape()
                                          for n, c, o in zip(sizes, contexts, outputs)), graph=graph))
                for j in range(k)]

    def serving_host_s(self) -> tuple[float, float]:
        """Host CPU seconds a one-rank HTTP worker spends outside its engine's steps, in series with them (one
        process, one GIL): (per request: parsing, tokenizing; per answer token: detokenizing, streaming). mode=sim
        adds a request's to the step after its arrival and a token's to the step that samples it. Default (0, 0):
        not priced."""
        return 0.0, 0.0

    def placement_moves(self, forward_pass: int) -> dict[str, float]:
        """Expert re-placement (EPLB) at the end of the instance's `forward_pass`-th forward pass (from 1): the MoE
        contract's counters (framework.model.moe_stats.PLACEMENT_KEYS) and `eplb_stall_s`, the seconds serving stops
        while weights move. Empty (the default): the model places no experts."""
        return {}

    def kv_link(self, intra_node: bool) -> tuple[float, float]:
        """Prefill/decode disaggregation: (bytes/s, seconds) of one GPU's link that a KV transfer between two
        instances takes, one direction, and its latency per transfer: NVLink inside a node, the GPU's NIC between
        nodes (`hardware.nvlink_gb_s`, `inter_node_gb_s`). The simulator (framework/sim/pd.py) runs an instance's
        ranks' links in parallel and shares each among the transfers using it. Default: the spec-sheet peak, no
        latency; a model with measured link terms overrides it."""
        hw = self.instance.hardware
        return (hw.nvlink_gb_s if intra_node else hw.inter_node_gb_s) * 1e9, 0.0

    def kv_transfer_time(self, nbytes: float, intra_node: bool, lanes: int = 1) -> float:
        """Seconds to move `nbytes` of KV over `lanes` such links in parallel, alone on them (no contention)."""
        bandwidth, latency = self.kv_link(intra_node)
        return latency + nbytes / (bandwidth * max(lanes, 1)) if nbytes > 0 else 0.0


def decode_shape(n: int, context: int, outputs: int = 0) -> BatchShape:
    """A DECODE batch of n requests holding `context` tokens of KV in all and having generated `outputs`, in one
    canonical form (the whole context on the first request), so a step priced alone or in a run gets the very same
    shape."""
    return BatchShape("decode", (1,) * n, (context,) + (0,) * (n - 1), outputs)


def batch_shape(batch: ForwardBatch, outputs: bool = False) -> BatchShape:
    """A scheduler's batch as a cost model sees it (the simulator prices it; the real engine's step log records it);
    `outputs`: count a DECODE batch's generated tokens (else 0)."""
    if batch.mode.is_idle():
        return BatchShape()
    if batch.mode.is_decode():
        return decode_shape(len(batch.reqs), sum(batch.seq_lens_cpu) - len(batch.reqs),
                            sum(len(r.output_ids) for r in batch.reqs) if outputs else 0)
    return BatchShape("extend", tuple(batch.extend_lens), tuple(batch.prefix_lens))
