"""One rank's engine: the model (sharded by the parallelism plugin), the MoE backends, the KV pool and the
scheduler, stepped one batch at a time; and how a rank's memory is split between weights and KV (`plan_memory`)."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from framework.contracts.batch import ForwardBatch
from framework.contracts.cost import batch_shape
from framework.engine.config import EngineConfig
from framework.engine.host_memory import keep_freed_host_memory
from framework.engine.cuda_graph import CudaGraphCapture, Decision, GraphRunner
from framework.engine.kv_pool import KVPool
from framework.engine.request import Req
from framework.engine.sampling import sample
from framework.engine.scheduler import Scheduler
from framework.engine.stats import rank_snapshot, step_cpu_key
from framework.engine.step import InstanceStep, StepPlan
from framework.model.config import ModelConfig
from framework.model.model import build_model
from framework.model.tokenizer import ByteTokenizer
from framework.model.moe_stats import placement_stats, rank_expert_counts
from framework.core.registry import MOE

log = logging.getLogger(__name__)
_ENGINES = itertools.count()    # engine.step_cpu_log: each engine of a process writes its own file


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device=cuda but no CUDA device is visible; use engine.device=cpu or auto")
    return torch.device(name)


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory: `weight_bytes` by part (the heaviest rank's: every rank sizes its KV pool alike, as SGLang
    takes the minimum free memory over the ranks), the KV pool's capacity in tokens, and which budget set it."""
    sizing: str                     # "mem_budget": KV = engine.mem_budget_mb - weights | "kv_budget": KV = kv_budget_mb
    weight_bytes: dict[str, int]
    kv_bytes_per_token: int
    kv_tokens: int

    @property
    def weight_bytes_total(self) -> int:
        return sum(self.weight_bytes.values())


def plan_memory(model_cfg: ModelConfig, engine_cfg: EngineConfig, par_cls, par_cfg, moe_cls, moe_cfg) -> MemoryPlan:
    """SGLang's profile_max_num_token from shapes alone: KV tokens = (static budget - this rank's weights) // bytes
    per token. The parallelism plugin declares its parts' bytes, the MoE backend its routed experts'. Raises
    ValueError when the budget leaves no token of KV."""
    size = par_cfg.size
    moe_partial = moe_cls.layout(moe_cfg, size)[1]
    heaviest = max(({**par_cls.weight_bytes(par_cfg, model_cfg, rank, moe_partial),
                     "routed_experts": moe_cls.weight_bytes(moe_cfg, model_cfg, rank, size)} for rank in range(size)),
                   key=lambda parts: sum(parts.values()))
    per_token = par_cls.kv_bytes_per_token(model_cfg)
    if engine_cfg.kv_budget_mb is not None:
        return MemoryPlan("kv_budget", heaviest, per_token, int(engine_cfg.kv_budget_mb * 2**20) // per_token)
    plan = MemoryPlan("mem_budget", heaviest, per_token,
                      (int(engine_cfg.mem_budget_mb * 2**20) - sum(heaviest.values())) // per_token)
    if plan.kv_tokens < 1:
        weights_mb = plan.weight_bytes_total / 2**20
        raise ValueError(f"engine.mem_budget_mb={engine_cfg.mem_budget_mb:g} leaves no KV on a rank: its weights take "
                         f"{weights_mb:.3f} MB under parallel={par_cfg.name} x{size}, moe={moe_cfg.name}; raise "
                         f"engine.mem_budget_mb above {weights_mb:.3f} or set engine.kv_budget_mb")
    return plan


class Engine:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, par, moe_cfg, seed: int,
                 device: torch.device | None = None):
        engine_cfg.validate()
        if model_cfg.weight_dtype is not None:
            raise ValueError(f"model.weight_dtype={model_cfg.weight_dtype} sizes and prices weights in mode=sim only; "
                             f"the engine builds {model_cfg.dtype} weights (drop model.weight_dtype)")
        self.model_cfg, self.cfg, self.par = model_cfg, engine_cfg, par
        self.device = device or pick_device(engine_cfg.device)
        if engine_cfg.host_allocator_cache and self.device.type == "cpu":
            keep_freed_host_memory()
        self.tokenizer = ByteTokenizer(model_cfg.vocab_size)
        self.model = build_model(model_cfg, seed, self.device)
        for layer in self.model.moe_layers():      # backends first: how the plugin shards shared experts follows them
            layer.backend = MOE.build(moe_cfg.name, moe_cfg, layer.w13, layer.w2, par.group)
            del layer.w13, layer.w2                # the backend kept its rank's part; the full copy would waste memory
        par.shard(self.model)
        self.memory = plan_memory(model_cfg, engine_cfg, type(par), par.cfg, MOE.get(moe_cfg.name), moe_cfg)
        self.pool = KVPool(model_cfg.num_layers, model_cfg.kv_cache_width, self.memory.kv_tokens,
                           getattr(torch, model_cfg.dtype), self.device)
        self.scheduler = Scheduler(engine_cfg, self.pool, self.tokenizer.eos_token_id,
                                   lambda ids: self.tokenizer.decode(ids), par.schedule_conservativeness,
                                   context_len=model_cfg.max_position_embeddings)
        # the ranks of a DP group run one batch and must draw the same tokens; DP groups serve different requests
        self.generator = torch.Generator().manual_seed(seed * 1009 + par.dp_rank)
        self.requests = 0              # requests this rank took
        self.logit_hook = None         # verify mode: called with (req, logits row) for each sampled token
        # wall seconds in scheduling and in the forward; this thread's CPU seconds in steps whose batch extends and in
        # the others (the simulator reports its priced seconds under the same keys: sim_fidelity compares them)
        self.timing = {"schedule_s": 0.0, "forward_s": 0.0, "extend_cpu_s": 0.0, "decode_cpu_s": 0.0}
        # one file per engine (several may share a process: in-process ranks, cluster.http=false), line-buffered
        self._step_cpu_file = open(f"{engine_cfg.step_cpu_log}.{os.getpid()}.{next(_ENGINES)}.jsonl", "a",
                                   buffering=1) if engine_cfg.step_cpu_log else None
        self.graphs = GraphRunner(engine_cfg, self.model, self.pool, par, self.scheduler.req_to_token.table,
                                  self.scheduler.max_running, self.device)
        if engine_cfg.cuda_graph and self.device.type == "cuda":
            self.graphs.capture(CudaGraphCapture(self.device))
        elif engine_cfg.cuda_graph:
            log.info("no CUDA: CUDA graphs off (engine.cuda_graph=true on %s); decode runs eagerly", self.device)
        # this rank's side of the instance step: its DP group; the others' bids come through the plugin's sync_step
        self.instance_step = InstanceStep([self.scheduler], [par.dp_rank],
                                          [type(par).dp_rank_of(par.cfg, r) for r in range(par.size)], [self.graphs],
                                          exchange=lambda bids: par.sync_step(bids[0]))

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def add(self, req: Req) -> None:
        self.scheduler.add(req)
        self.requests += 1

    def step(self) -> list[Req] | None:
        """Run one instance step on this rank (framework/engine/step.py, with `execute` as its forward). Returns the
        requests that got a token (None when no step ran)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = self.instance_step.start(self)
        if plan is None:
            return None
        out = self.instance_step.finish(plan, time.perf_counter())
        self.timing["forward_s"] += plan.seconds
        self.timing["schedule_s"] += time.perf_counter() - t0 - plan.seconds
        cpu = time.thread_time() - c0
        self.timing[step_cpu_key(plan.batches)] += cpu
        if self._step_cpu_file is not None:     # (outside the CPU counted: the log does not time itself)
            self._step_cpu_file.write(json.dumps({
                "rank": self.par.rank, "size": self.par.size, "dp_rank": self.par.dp_rank, "cpu_s": cpu,
                "batches": [asdict(batch_shape(b)) for b in plan.batches]}) + "\n")
        return out

    def execute(self, plan: StepPlan) -> None:
        """The step's executor on a rank: the forward pass of its batch, then sampling (the simulator's executor is
        a cost model)."""
        batch = plan.batches[0]
        t0 = time.perf_counter()
        logits = self.forward(batch, plan.decisions[0])
        plan.seconds = time.perf_counter() - t0
        rows = [i for i, s in enumerate(batch.sample) if s]
        reqs = [batch.reqs[i] for i in rows]
        tokens = sample(logits[rows], [r.params for r in reqs], self.generator) if rows else []
        if self.logit_hook is not None:
            for req, i in zip(reqs, rows):
                self.logit_hook(req, logits[i])
        plan.tokens = [tokens]

    def forward(self, batch: ForwardBatch, decision: Decision | None = None) -> torch.Tensor:
        """The one call the step makes into the model: through a captured graph when the step's graph decision
        replays one. A copy: a graph's next replay overwrites its output."""
        return self.graphs.forward(batch.to(self.device), decision).to("cpu", torch.float32, copy=True)

    def server_info(self) -> dict:
        """This rank's snapshot: load, KV, memory, its scheme (`par.describe()`), step counters, timing and expert
        counts. framework.engine.stats builds an instance's figures from its ranks' snapshots."""
        par = self.par
        counts, local = rank_expert_counts(self.model)
        return rank_snapshot(self.scheduler, par.describe(par.cfg), par.rank, par.dp_rank, par.leads, self.memory,
                             self.requests, {**par.stats, **self.instance_step.counters[0], **self.graphs.stats,
                                                  **self.timing, **placement_stats(self.model),
                                                  "collectives": par.collectives}, counts, local)
