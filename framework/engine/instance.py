"""A multi-rank engine instance: `parallel.size` ranks, one `Engine` each, stepping together.

Rank 0 talks to the parent (framework.engine.instance_client) over the launch channel. Each step of the instance:

1. exchange (one object collective on the control group): rank 0's new commands (requests, aborts, flush, stop) go
   down; under DP attention the other ranks' outputs of their previous step and their load come up in the same
   all_gather_object. Under TP every rank holds the same requests, so rank 0 broadcasts and needs nothing back.
2. every rank applies the commands: TP adds every request; DP attention adds the requests the DataParallelController
   on rank 0 assigned to it.
3. `Engine.step()`: the parallelism plugin's sync_step, then the forward with its collectives.

Rank 0 forwards the step's outputs (its own at once, the others' one step later) to the parent. When the whole
instance is idle, rank 0 waits on the channel, but exchanges at least every HEARTBEAT_S so the others' control
collectives (timeout: parallel.timeout_s + HEARTBEAT_S) never expire while the instance is merely idle.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.engine.engine import Engine
from framework.engine.request import Req
from framework.model.config import ModelConfig
from framework.moe_stats import rank_expert_counts
from framework.registry import PARALLELISM
from framework.engine.dp_controller import DataParallelController

HEARTBEAT_S = 1.0      # an idle rank 0 still exchanges this often
INFO_EVERY_S = 0.2     # how often rank 0 pushes a server_info snapshot to the parent while busy


@dataclass
class InstanceSpec:
    """Everything a rank needs to build its engine (picklable: it travels to spawned ranks)."""
    model: ModelConfig
    engine: EngineConfig
    parallel: Any               # the parallelism plugin's Config
    moe: Any                    # the MoE backend's Config
    seed: int = 0
    cases: list[tuple] = field(default_factory=list)   # verify: (name, EngineConfig, MoE config), one engine each


def control_group(group: Group, timeout_s: float) -> Group:
    """A gloo group over the same ranks for scheduling metadata (SGLang's tp_cpu_group)."""
    if group.size == 1:
        return Group()
    import torch.distributed as dist
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Group(group.rank, group.size, "gloo", "cpu", timeout_s, pg=pg)


def build_rank_engine(spec: InstanceSpec, group: Group, control: Group, engine_cfg: EngineConfig | None = None,
                      moe_cfg=None) -> Engine:
    par = PARALLELISM.build(spec.parallel.name, spec.parallel, group, control)
    device = None if group.backend == "local" else group.device
    return Engine(spec.model, engine_cfg or spec.engine, par, moe_cfg or spec.moe, spec.seed, device=device)


def out_record(req: Req) -> tuple:
    """What the parent needs of a request that got a token this step."""
    return ("tok", req.rid, len(req.output_ids), req.output_ids[-1], req.finish_reason, max(req.cached_tokens, 0))


class RankLoop:
    """One rank's side of the instance protocol; `run()` returns this rank's statistics at the "stop" command."""

    def __init__(self, engine: Engine, control: Group, channel=None):
        self.engine, self.par, self.control, self.channel = engine, engine.par, control, channel
        self.rank, self.size = control.rank, control.size
        self.replicated = self.par.replicates_batch or self.size == 1
        self.controller = (DataParallelController(self.size, self.par.cfg.dp_balance)
                           if self.rank == 0 and not self.replicated else None)
        self.loads = [0] * self.size         # requests per rank at the last exchange (DP)
        self.infos: list[dict] = [{}] * self.size
        self.sent_cmds = False               # the last exchange carried commands: the ranks may have new work
        self.pending: list[tuple] = []       # DP ranks > 0: records for the next exchange
        self.outbox: list[tuple] = []        # rank 0: records for the parent
        self.added: list[Req] = []           # every request this rank took (verify reads them)
        self.peak_running = 0
        self.steps = 0
        self._info_sent = 0.0

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.rank == 0:
            self._observe()
            self.channel.send(("ready", self.instance_info()))
        while True:
            cmds = self._inbox() if self.rank == 0 else None
            cmds = self._exchange(cmds)
            if self._apply(cmds):
                break
            records = [out_record(r) for r in self.engine.step() or ()]
            if self.rank == 0:
                self.outbox += records
                self._observe()
                self._flush_outbox()
            elif not self.replicated:
                self.pending += records
        return self.stats()

    def _inbox(self) -> list[tuple]:
        """Rank 0: the parent's messages, as commands for every rank (DP: each add gets its rank here)."""
        busy = self.engine.scheduler.has_work() or any(self.loads) or self.sent_cmds
        if not busy:                         # about to wait: let the parent see the idle state now
            self._flush_outbox(force_info=True)
        msgs = []
        try:
            if self.channel.poll(0 if busy else HEARTBEAT_S):
                msgs.append(self.channel.recv())
                while self.channel.poll(0):
                    msgs.append(self.channel.recv())
        except EOFError:                     # the parent is gone: stop the instance
            msgs.append(("stop",))
        cmds = []
        for msg in msgs:
            if msg[0] == "add" and self.controller is not None:
                try:
                    msg = msg[:5] + (self.controller.assign(msg[5]),)
                except ValueError as e:
                    self.outbox.append(("reject", msg[1], str(e)))
                    continue
            elif msg[0] == "flush":
                ok = not busy and not any(c[0] == "add" for c in cmds)
                self.channel.send(("flushed", msg[1], ok))
                if not ok:
                    continue
                msg = ("flush",)
            cmds.append(msg)
        return cmds

    def _exchange(self, cmds: list[tuple] | None) -> list[tuple]:
        self.steps += 1
        self.control.step = self.par.group.step = self.steps
        if self.size == 1:
            out = cmds
        elif self.replicated:
            out = self.control.broadcast_object(cmds)
        else:
            payload = (cmds, self.pending, self._own_info())
            gathered = self.control.all_gather_object(payload)
            self.pending = []
            out = gathered[0][0]
            self.infos = [g[2] for g in gathered]
            self.loads = [i["running_requests"] + i["queued_requests"] for i in self.infos]
            if self.rank == 0:
                for _, records, _ in gathered[1:]:
                    self.outbox += records
                self.controller.update(self.loads)
                self.peak_running = max(self.peak_running, sum(i["running_requests"] for i in self.infos))
        self.sent_cmds = bool(out)
        return out

    def _apply(self, cmds: list[tuple]) -> bool:
        """Returns True at "stop"."""
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt_ids, params, arrival, target = cmd
                if self.replicated or target == self.rank:
                    self._add(Req(prompt_ids, params, rid=rid, arrival_time=arrival))
            elif kind == "abort":
                self.engine.scheduler.abort(cmd[1])
            elif kind == "flush":
                self.engine.scheduler.cache.reset()
            elif kind == "stop":
                return True
        return False

    def _add(self, req: Req) -> None:
        try:
            self.engine.add(req)
            self.added.append(req)
        except ValueError as e:              # can never fit on this rank: the parent fails this request
            if self.rank == 0:
                self.outbox.append(("reject", req.rid, str(e)))
            elif not self.replicated:
                self.pending.append(("reject", req.rid, str(e)))

    # -- what rank 0 tells the parent -----------------------------------------------------------------------
    def _own_info(self) -> dict:
        return self.engine.server_info()

    def _observe(self) -> None:
        """Rank 0 after its step: refresh its own info. The instance's peak of running requests is the one shared
        batch under TP; under DP attention the sum over ranks, taken at each exchange (all ranks after one step)."""
        self.infos = [self._own_info()] + self.infos[1:]
        if self.replicated:
            self.peak_running = max(self.peak_running, self.infos[0]["running_requests"])

    def instance_info(self) -> dict:
        own = self.infos[0]
        ranks = self.infos if not self.replicated else [own]
        per_rank_capacity = own["kv_capacity_tokens"]

        def total(key: str) -> int:
            return sum(i.get(key, 0) for i in ranks)
        return {"parallel": self.par.cfg.name, "parallel_size": self.size,
                "running_requests": total("running_requests"), "queued_requests": total("queued_requests"),
                "kv_capacity_tokens": per_rank_capacity * len(ranks), "kv_capacity_tokens_per_rank": per_rank_capacity,
                "kv_used_tokens": total("kv_used_tokens"), "cache_tokens": total("cache_tokens"),
                "kv_bytes_per_token_per_rank": own["kv_bytes_per_token"], "retractions": total("retractions"),
                "max_running_requests": self.peak_running,
                "per_rank_requests": [i.get("running_requests", 0) + i.get("queued_requests", 0) for i in ranks]}

    def _flush_outbox(self, force_info: bool = False) -> None:
        now = time.monotonic()
        info = None
        if force_info or now - self._info_sent >= INFO_EVERY_S:
            info, self._info_sent = self.instance_info(), now
        if self.outbox or info is not None:
            self.channel.send(("out", self.outbox, info))
            self.outbox = []

    def stats(self) -> dict:
        s = self.engine.scheduler.stats
        return {"rank": self.rank, "kv_capacity_tokens": self.engine.capacity,
                "kv_bytes_per_token": self.engine.kv_bytes_per_token, "retractions": s["retractions"],
                "max_running_requests": s["max_running_requests"], "extend_steps": s["extend_steps"],
                "decode_steps": s["decode_steps"], "requests": len(self.added), **self.par.stats,
                "instance_steps": self.steps, "timing": dict(self.engine.timing),
                "instance_peak_running": self.peak_running if self.rank == 0 else None,
                "assigned": self.controller.assigned if self.controller is not None else None,
                "expert_counts": rank_expert_counts(self.engine.model)}


# -- rank functions (module level: spawned ranks import them by name) -------------------------------------------
def serve_rank(group: Group, channel, spec: InstanceSpec) -> dict:
    """Serve requests from the parent until it sends "stop"."""
    torch.set_grad_enabled(False)
    control = control_group(group, spec.parallel.timeout_s + HEARTBEAT_S + 5.0)
    engine = build_rank_engine(spec, group, control)
    return RankLoop(engine, control, channel).run()


def verify_rank(group: Group, channel, spec: InstanceSpec) -> dict:
    """verify mode: for each case a fresh engine serves the parent's requests until "stop"; returns every
    sampled token's logits of the requests this rank served, plus its sync_step log."""
    torch.set_grad_enabled(False)
    control = control_group(group, spec.parallel.timeout_s + HEARTBEAT_S + 5.0)
    results = {}
    for name, engine_cfg, moe_cfg in spec.cases:
        engine = build_rank_engine(spec, group, control, engine_cfg, moe_cfg)
        logits: dict[str, list[torch.Tensor]] = {}
        engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row.clone())
        engine.par.step_log = []
        loop = RankLoop(engine, control, channel)
        stats = loop.run()
        results[name] = {"stats": stats, "step_log": engine.par.step_log,
                         "requests": {r.rid: (r.prompt_ids, r.output_ids) for r in loop.added},
                         "logits": {rid: torch.stack(rows) for rid, rows in logits.items()}}
    return results
