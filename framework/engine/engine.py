"""One rank's engine: the model (sharded by the parallelism plugin), the MoE backends, the KV pool and the
scheduler, stepped one batch at a time."""
from __future__ import annotations

import logging
import time

import torch

from framework.engine.batch import ForwardBatch
from framework.engine.config import EngineConfig
from framework.engine.kv_pool import KVPool
from framework.engine.request import Req
from framework.engine.sampling import sample
from framework.engine.scheduler import Scheduler
from framework.model.config import ModelConfig
from framework.model.model import build_model
from framework.model.tokenizer import ByteTokenizer
from framework.registry import MOE

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device=cuda but no CUDA device is visible; use engine.device=cpu or auto")
    return torch.device(name)


class Engine:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, par, moe_cfg, seed: int,
                 device: torch.device | None = None):
        engine_cfg.validate()
        self.model_cfg, self.cfg, self.par = model_cfg, engine_cfg, par
        self.device = device or pick_device(engine_cfg.device)
        self.tokenizer = ByteTokenizer(model_cfg.vocab_size)
        self.model = build_model(model_cfg, seed, self.device)
        for layer in self.model.moe_layers():      # backends first: how the plugin shards shared experts follows them
            layer.backend = MOE.build(moe_cfg.name, moe_cfg, layer.w13, layer.w2, par.group)
            del layer.w13, layer.w2                # the backend kept its rank's part; the full copy would waste memory
        par.shard(self.model)
        self.kv_bytes_per_token = par.kv_bytes_per_token(model_cfg)
        capacity = int(engine_cfg.kv_budget_mb * 2**20) // self.kv_bytes_per_token
        self.pool = KVPool(model_cfg.num_layers, model_cfg.kv_cache_width, capacity,
                           getattr(torch, model_cfg.dtype), self.device)
        self.scheduler = Scheduler(engine_cfg, self.pool, self.tokenizer.eos_token_id,
                                   lambda ids: self.tokenizer.decode(ids), par.cfg.schedule_conservativeness,
                                   context_len=model_cfg.max_position_embeddings)
        # TP ranks run one batch and must draw the same tokens; DP ranks serve different requests
        self.generator = torch.Generator().manual_seed(seed * 1009 + par.sampling_seed_offset)
        self.logit_hook = None         # verify mode: called with (req, logits row) for each sampled token
        self.timing = {"schedule_s": 0.0, "forward_s": 0.0, "steps": 0}

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def add(self, req: Req) -> None:
        self.scheduler.add(req)

    def step(self) -> list[Req] | None:
        """Run one step. Returns the requests that got a token (None when no step ran)."""
        t0 = time.perf_counter()
        batch = self.par.sync_step(self.scheduler.next_batch())
        if batch is None:
            return None
        t1 = time.perf_counter()
        logits = self.forward(batch)
        t2 = time.perf_counter()
        rows = [i for i, s in enumerate(batch.sample) if s]
        reqs = [batch.reqs[i] for i in rows]
        tokens = sample(logits[rows], [r.params for r in reqs], self.generator) if rows else []
        if self.logit_hook is not None:
            for req, i in zip(reqs, rows):
                self.logit_hook(req, logits[i])
        out = self.scheduler.process(batch, tokens, time.perf_counter())
        self.timing["schedule_s"] += (t1 - t0) + (time.perf_counter() - t2)
        self.timing["forward_s"] += t2 - t1
        self.timing["steps"] += 1
        return out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The one call the scheduler's step makes into the model (a simulator replaces it with a cost model)."""
        return self.model(batch.to(self.device), self.pool, self.par).float().cpu()

    def server_info(self) -> dict:
        s = self.scheduler
        return {"running_requests": s.num_running(), "queued_requests": len(s.waiting),
                "kv_capacity_tokens": self.capacity, "kv_used_tokens": self.pool.used(),
                "cache_tokens": s.cache.total_size(), "kv_bytes_per_token": self.kv_bytes_per_token,
                **s.stats}
