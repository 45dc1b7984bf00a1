"""An engine instance's ranks: `parallel.size` of them, one `Engine` each, stepping together (one rank: the same
loop in a thread of the client's process, framework.instance.local).

Rank 0 talks to the parent (framework.instance.client) over the launch channel, in the typed messages below.
Each step of the instance:

1. exchange (one all_gather_object on the control group): rank 0's new commands go down; every rank's snapshot and
   the outputs of each DP group's leader from its previous step come up.
2. every rank applies the commands: each `Add` goes to the ranks of the DP group rank 0's dispatcher picked.
3. `Engine.step()`: the instance step (framework/engine/step.py: the DP groups' bids through the parallelism
   plugin's sync_step, IDLE batches, graph decisions, the peak), then the forward with its collectives.

Rank 0 forwards the step's outputs (its own at once, the other groups' one step later) to the parent, with the
instance's stats (framework.engine.stats) every INFO_EVERY_S. When the whole instance is idle, rank 0 waits on the
channel, but exchanges at least every HEARTBEAT_S so the others' control collectives (timeout: parallel.timeout_s +
HEARTBEAT_S) never expire while the instance is merely idle.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from framework.dist.group import Group
from framework.engine.config import EngineConfig, Role
from framework.engine.disagg import Pairing
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.engine.scheduler import check_admissible
from framework.engine.stats import instance_stats
from framework.model.config import ModelConfig
from framework.core.registry import PARALLELISM
from framework.kv_events.events import KVEventBatch
from framework.kv_events.relay import EventRelay
from framework.instance.kv_connector import (IDLE_POLL_S, POLL_S, KVAllocated, KVBootstrapped, KVConnector, KVDone,
                                             KVFailed)

HEARTBEAT_S = 1.0      # an idle rank 0 still exchanges this often
INFO_EVERY_S = 0.2     # how often rank 0 pushes the instance's stats to the parent while busy


@dataclass
class InstanceSpec:
    """Everything a rank needs to build its engine (picklable: it travels to spawned ranks)."""
    model: ModelConfig
    engine: EngineConfig
    parallel: Any               # the parallelism plugin's Config
    moe: Any                    # the MoE backend's Config
    seed: int = 0
    cases: list[tuple] = field(default_factory=list)   # verify: (name, EngineConfig, MoE config), one engine each
    kv_events_block_size: int = 0   # > 0: each DP group's radix cache's KV events, in blocks of this many tokens, go
                                    # to the parent (its worker publishes them to routers), stamped with the group


# -- commands: parent -> rank 0 -> every rank --------------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    dp_rank: Optional[int] = None     # the parent's pin; rank 0 replaces it by its dispatcher's choice
    pairing: Optional[Pairing] = None  # prefill/decode disaggregation: SGLang's bootstrap fields


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Flush:
    token: int                        # forwarded to every rank only when no request is in flight


@dataclass(frozen=True)
class Stop:
    pass


# -- events: a DP group's leader -> rank 0 -> parent ---------------------------------------------------------------
@dataclass(frozen=True)
class TokenOut:
    """A request got its n_out-th token."""
    rid: str
    n_out: int
    token: int
    finish_reason: Optional[str]
    cached_tokens: int
    kv_transfer_bytes: int = 0        # disaggregation: what the request's KV transfer moved, and in how long
    kv_transfer_s: float = 0.0
    engine_ttft_s: Optional[float] = None   # its arrival to its first token, as the rank's scheduler stamped it

    @classmethod
    def of(cls, req: Req) -> "TokenOut":
        return cls(req.rid, len(req.output_ids), req.output_ids[-1], req.finish_reason, max(req.cached_tokens, 0),
                   req.kv_transfer_bytes, req.kv_transfer_s, req.engine_ttft_s)


@dataclass(frozen=True)
class Rejected:
    """A request that can never run on its rank."""
    rid: str
    error: str


@dataclass(frozen=True)
class TransferFailed:
    """A disaggregated request's KV transfer failed (its peer died, timed out or cancelled): the request fails."""
    rid: str
    error: str


# -- rank 0 -> parent ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    stats: dict


@dataclass(frozen=True)
class Outputs:
    events: list                      # TokenOut | Rejected, in the order they happened per DP group
    stats: Optional[dict]             # the instance's stats, every INFO_EVERY_S and when it goes idle
    kv_events: list = field(default_factory=list)   # KVEventBatch per DP group (InstanceSpec.kv_events_block_size)


@dataclass(frozen=True)
class Flushed:
    token: int
    ok: bool


@dataclass(frozen=True)
class Report:
    """What every rank contributes to a step's exchange."""
    commands: list                    # rank 0's, for every rank
    events: list                      # a leader's events of its previous step
    snapshot: dict                    # Engine.server_info()
    kv_events: list = field(default_factory=list)   # a leader's KV events for the parent, one batch (or none)


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


class RankLoop:
    """One rank's side of the instance protocol; `run()` returns this rank's final snapshot at `Stop`."""

    def __init__(self, engine: Engine, control: Group, channel=None, kv_events_block_size: int = 0):
        self.engine, self.par, self.control, self.channel = engine, engine.par, control, channel
        self.rank, self.size = control.rank, control.size
        self.dispatcher = self.par.dispatcher() if self.rank == 0 else None
        # dp_balance=precise: rank 0's controller watches its own group's radix cache; each other group's leader
        # relays its cache's KV events to it in the step's exchange
        if self.rank == 0:
            self.dispatcher.watch(self.par.dp_rank, engine.scheduler.cache)
        self.relay = self.par.dispatcher().relay(self.par.dp_rank, engine.scheduler.cache) \
            if self.rank and self.par.leads else None
        # kv_events_block_size: each leader's KV events for the parent ride the same exchange (rank 0's own go
        # straight into its outbox); one group's are not stamped with a rank, as vLLM's single-rank publisher
        self.cache_events = EventRelay(engine.scheduler.cache, kv_events_block_size,
                                       self.par.dp_rank if type(self.par).dp_size(self.par.cfg) > 1 else None) \
            if kv_events_block_size and self.par.leads else None
        self.kv_out: list[KVEventBatch] = []   # rank 0: the KV events for the parent
        self.snapshots: list[dict] = []      # every rank's, as of the last exchange
        self.sent_cmds = False               # the last exchange carried commands: the ranks may have new work
        self.sent_adds = False               # ... and requests the snapshots may not show yet
        self.pending: list = []              # a leader's events for the next exchange (rank 0: for the parent)
        self.added: list[tuple[int, Req]] = []   # verify: every request this rank took, after how many step rounds
        self.steps = 0
        self._info_sent = 0.0
        # a prefill or decode instance's KV connector (every rank registers its pool; rank 0 pairs the rooms)
        self.kv = KVConnector(engine, control) if engine.cfg.role != Role.mixed else None
        self._was_busy = True

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            return self._run()
        finally:
            if self.kv is not None:
                self.kv.close()

    def _run(self) -> dict:
        self.snapshots = self.control.all_gather_object(self.engine.server_info())   # before any step
        if self.rank == 0:
            self.channel.send(Ready(self.stats()))
        while True:
            cmds = self._exchange(self._inbox() if self.rank == 0 else None)
            if self._apply(cmds):
                break
            if (reqs := self.engine.step()) and self.par.leads:
                # a prefill instance answers a paired request once its KV is sent (KVDone), not at its first token
                self.pending += [TokenOut.of(r) for r in reqs if not (r.pairing is not None and self.kv is not None
                                                                      and r.rid in self.kv.disagg.sending)]
            if self.kv is not None and self.rank:
                self.pending += self.kv.poll()        # a decode DP group's allocations, for rank 0
            if self.rank == 0:
                self.snapshots[0] = self.engine.server_info()
                self._flush_outbox()
        return self.engine.server_info()

    def _inbox(self) -> list:
        """Rank 0: the parent's messages, as commands for every rank (each Add gets its DP group here)."""
        loads = self._group_loads()
        stepping = self.engine.scheduler.has_work() or any(loads) or self.sent_adds
        kv_busy = self.kv is not None and self.kv.busy()      # transfers pending: look for their news often
        busy = stepping or kv_busy
        if not busy and not self.sent_cmds and (self.kv is None or self._was_busy):
            self._flush_outbox(force_info=True)   # about to wait: let the parent see the idle state now (a P/D
        self._was_busy = busy or self.sent_cmds   # instance waits briefly, so only as it goes idle)
        msgs = []
        try:
            idle_wait = HEARTBEAT_S if self.kv is None else POLL_S if kv_busy else IDLE_POLL_S
            ready = self.channel.poll(0 if stepping or self.sent_cmds else idle_wait)
            while ready:
                msg = self.channel.recv()
                if isinstance(msg, list):    # requests submitted together (InstanceClient.submit_together)
                    msgs += msg
                else:
                    msgs.append(msg)
                ready = self.channel.poll(0)
        except EOFError:                     # the parent is gone: stop the instance
            msgs.append(Stop())
        self.dispatcher.update(loads)
        cmds = []
        for msg in msgs:
            if isinstance(msg, Add):
                try:
                    msg = dataclasses.replace(msg, dp_rank=self.dispatcher.assign(msg.dp_rank, msg.prompt_ids))
                except ValueError as e:
                    self.pending.append(Rejected(msg.rid, str(e)))
                    continue
            elif isinstance(msg, Abort) and self.kv is not None:
                self.kv.abort(msg.rid)
            elif isinstance(msg, Flush) and (busy or any(isinstance(c, Add) for c in cmds)):
                self.channel.send(Flushed(msg.token, False))   # requests in flight: nothing done
                continue
            cmds.append(msg)
        if self.kv is not None:
            cmds += self.kv.poll()
        return cmds

    def _exchange(self, cmds: list | None) -> list:
        self.steps += 1
        self.par.set_step(self.steps)
        if self.size > 1:
            ups = (self.pending + (self.relay.drain() if self.relay is not None else [])) if self.rank else []
            kv = self.cache_events.drain() if self.rank and self.cache_events is not None else []
            reports = self.control.all_gather_object(Report(cmds or [], ups, self.engine.server_info(), kv))
            if self.rank:
                self.pending = []
            cmds = reports[0].commands
            self.snapshots = [r.snapshot for r in reports]
            if self.rank == 0:
                for report in reports[1:]:
                    self.pending += report.events
                    self.kv_out += report.kv_events
                for batch in [e for e in self.pending if isinstance(e, KVEventBatch)]:
                    self.dispatcher.feed(batch)
                self.pending = [e for e in self.pending if not isinstance(e, KVEventBatch)]
                if self.kv is not None:               # what the other DP groups' leaders allocated: rank 0 asks
                    for event in [e for e in self.pending if isinstance(e, KVAllocated)]:
                        self.kv.allocated_elsewhere(event)
                    self.pending = [e for e in self.pending if not isinstance(e, KVAllocated)]
        self.sent_cmds = bool(cmds)
        # adds the gathered snapshots predate; one rank has none: its own snapshot is taken after each step, so a
        # request added and finished in one step (one token) drains the instance with fresh stats too
        self.sent_adds = self.size > 1 and any(isinstance(c, Add) for c in cmds)
        return cmds

    def _apply(self, cmds: list) -> bool:
        """Returns True at Stop."""
        for cmd in cmds:
            if isinstance(cmd, Add):
                if cmd.dp_rank == self.par.dp_rank:
                    self._add(Req(list(cmd.prompt_ids), cmd.params, rid=cmd.rid, arrival_time=cmd.arrival_time,
                                  pairing=cmd.pairing))
            elif isinstance(cmd, (KVDone, KVFailed)):
                self._transfer_news(cmd)
            elif isinstance(cmd, KVBootstrapped):     # SGLang's order: its room's destination came
                self.kv.disagg.admit(cmd.rid)
            elif isinstance(cmd, Abort):
                self.engine.scheduler.abort(cmd.rid)
            elif isinstance(cmd, Flush):
                self.engine.scheduler.cache.reset()
                if self.rank == 0:           # the others reset in this same step, before any new request
                    self.channel.send(Flushed(cmd.token, True))
            elif isinstance(cmd, Stop):
                return True
        return False

    def _transfer_news(self, cmd) -> None:
        """A KV transfer ended, on every rank in the same step (framework/engine/disagg.py frees or admits)."""
        disagg = self.kv.disagg
        if isinstance(cmd, KVFailed):
            req = disagg.failed(cmd.rid)
            if req is not None and self.par.leads:
                self.pending.append(TransferFailed(cmd.rid, cmd.error))
            return
        if self.kv.role is Role.prefill:
            req = disagg.sent(cmd.rid)
        else:
            req = disagg.arrived(cmd.rid, cmd.token, cmd.cached_tokens, time.perf_counter())
        if req is not None:
            req.kv_transfer_bytes, req.kv_transfer_s = cmd.nbytes, cmd.seconds
            if self.par.leads and req.finish_reason != "abort":
                self.pending.append(TokenOut.of(req))

    def _add(self, req: Req) -> None:
        try:
            if req.pairing is not None:
                if self.kv is not None and self.kv.waits_for_destination:
                    s = self.engine.scheduler         # SGLang's order: prefilled once its destination comes
                    req.params = dataclasses.replace(req.params, max_new_tokens=1)   # (as disagg.add does)
                    check_admissible(req, s.pool.capacity, s.context_len)
                    self.kv.disagg.park(req)
                else:
                    self.engine.scheduler.add_paired(req)
                self.engine.requests += 1
                self.added.append((self.engine.instance_step.attempts, req))
                return
            self.engine.add(req)
            self.added.append((self.engine.instance_step.attempts, req))
        except ValueError as e:              # can never fit on this rank: the parent fails this request
            if self.par.leads:
                self.pending.append(Rejected(req.rid, str(e)))

    # -- what rank 0 tells the parent -----------------------------------------------------------------------
    def _group_loads(self) -> list[int]:
        """Requests (running + queued) per DP group, as of the last exchange."""
        leaders = [s for s in self.snapshots if s["leads"]]
        return [s["running_requests"] + s["queued_requests"] for s in leaders]

    @property
    def peak_running(self) -> int:
        """The most requests running at once over the DP groups (the instance step counts it)."""
        return self.engine.instance_step.peak_running

    def stats(self) -> dict:
        info = instance_stats(self.snapshots, self.peak_running)
        return info if self.kv is None else {**info, **self.kv.stats()}

    def _flush_outbox(self, force_info: bool = False) -> None:
        now = time.monotonic()
        info = None
        # the finish that drains the instance goes out with fresh stats: a client that has every answer reads stats
        # that count every request (the periodic report could lag the last finishes by up to INFO_EVERY_S)
        drained = any(isinstance(o, TokenOut) and o.finish_reason is not None for o in self.pending) and \
            not (self.sent_adds or any(self._group_loads()))      # no group holds an unfinished request
        if force_info or drained or now - self._info_sent >= INFO_EVERY_S:
            info, self._info_sent = self.stats(), now
        if self.cache_events is not None:
            self.kv_out += self.cache_events.drain()
        if self.pending or self.kv_out or info is not None:
            self.channel.send(Outputs(self.pending, info, self.kv_out))
            self.pending, self.kv_out = [], []


# -- rank functions (module level: spawned ranks import them by name) -------------------------------------------
def serve_rank(group: Group, channel, spec: InstanceSpec) -> dict:
    """Serve requests from the parent until it sends Stop; returns this rank's final snapshot."""
    torch.set_grad_enabled(False)
    control = control_group(group, spec.parallel.timeout_s + HEARTBEAT_S + 5.0)
    engine = build_rank_engine(spec, group, control)
    loop = RankLoop(engine, control, channel, spec.kv_events_block_size)
    return {**loop.run(), "instance_peak_running": loop.peak_running}


def verify_rank(group: Group, channel, spec: InstanceSpec) -> dict:
    """verify mode: for each case a fresh engine serves the parent's requests until Stop; returns every sampled
    token's logits of the requests this rank served, plus its step log, its arrivals (step round, request id,
    prompt, sampling parameters: what a replay needs) and final snapshot."""
    torch.set_grad_enabled(False)
    control = control_group(group, spec.parallel.timeout_s + HEARTBEAT_S + 5.0)
    results = {}
    for name, engine_cfg, moe_cfg in spec.cases:
        engine = build_rank_engine(spec, group, control, engine_cfg, moe_cfg)
        logits: dict[str, list[torch.Tensor]] = {}
        engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row.clone())
        engine.instance_step.log = []
        loop = RankLoop(engine, control, channel)
        snapshot = loop.run()
        results[name] = {"stats": {**snapshot, "instance_peak_running": loop.peak_running},
                         "step_log": engine.instance_step.log,
                         "arrivals": [(at, r.rid, r.prompt_ids, r.params) for at, r in loop.added],
                         "requests": {r.rid: (r.prompt_ids, r.output_ids) for _, r in loop.added},
                         "logits": {rid: torch.stack(rows) for rid, rows in logits.items()}}
    return results
