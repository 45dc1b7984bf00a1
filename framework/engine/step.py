"""One instance step, written once: the ranks of a real instance and the simulator run this same code.

An instance has one or more DP groups (the parallelism plugin's layout), each with its own scheduler. A step:

1. every DP group forms its next batch (`Scheduler.next_batch`: EXTEND, DECODE or none);
2. the groups exchange bids (framework/contracts/step.py: tokens, decode or not, running requests). A rank holds one
   group and sends its bid through the parallelism plugin's `sync_step` (DP attention: one all-gather on the control
   group); the simulator holds every group, so nothing moves;
3. no group has tokens: no step. Else a group without a batch runs an IDLE one (it joins the others' collectives);
   every batch carries each rank's token count (`global_num_tokens`: DP attention pads its FFN exchange to them) and
   `can_run_graph` (every group in decode or idle); each group's graph decision is GraphPolicy.decide's, SGLang
   v0.4's rule (the most tokens of any rank against the largest captured batch);
4. the instance's peak of running requests (the groups' sum as their batches form), the counters and, when asked
   for, a step log entry are recorded;
5. an executor runs the step's forward: on a rank the model and sampling (`Engine.execute`), in the simulator the
   cost model on a virtual clock (framework/sim/instance.py); `finish` hands each group its sampled tokens.

Why here (engine/, L3) and not in instance/: a bare Engine steps itself (`Engine.step`, one rank), so the engine
needs the step. The simulator also advances runs of plain decode steps in one go (`run_ahead`, `advance`), with the
very decisions, counters and log of stepping one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

from framework.contracts.batch import ForwardBatch, ForwardMode
from framework.contracts.step import StepBid
from framework.engine.cuda_graph import Decision, GraphPolicy
from framework.engine.request import Req
from framework.engine.scheduler import Scheduler

COUNTERS = ("steps", "idle_steps", "graph_eligible_steps")     # per DP group; the graph counters: GraphPolicy's
NO_BID = StepBid(0, True, 0)                                   # a group without a batch


class GroupStep(NamedTuple):
    """One DP group's part of a step."""
    group: int          # the DP group
    mode: str           # extend | decode | idle
    tokens: int
    requests: int
    graph: str          # "replay", or why the group ran eagerly (framework.engine.cuda_graph.REASONS)


@dataclass(frozen=True)
class StepEntry:
    """A step log entry. `groups`: the DP groups that ran where it was logged (a rank: its own; the simulator: every
    one). The rest is the instance's, the same wherever it was logged."""
    groups: tuple[GroupStep, ...]
    tokens: tuple[int, ...]        # every DP group's tokens, as exchanged
    graph_eligible: bool           # every DP group in decode or idle
    running: int                   # requests running over the DP groups as the batches formed


@dataclass
class StepPlan:
    """A formed step: each local DP group's batch (IDLE included) and graph decision. The executor fills in the
    sampled tokens (per group, one per request whose `sample` is set) and the seconds its forward took."""
    batches: list[ForwardBatch]
    decisions: list[Decision]
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> None:
        """Run the plan's forward: fill in plan.tokens and plan.seconds."""


Exchange = Callable[[list[StepBid]], "list[StepBid] | None"]


class InstanceStep:
    def __init__(self, schedulers: list[Scheduler], groups: list[int], rank_groups: list[int],
                 policies: list[GraphPolicy], exchange: Exchange | None = None):
        """schedulers[i]: DP group groups[i]'s scheduler, decided for by policies[i]; rank_groups[r]: the DP group
        of rank r; exchange: the local groups' bids -> every DP group's in group order, or None when this rank sits
        the step out (default: every group is local)."""
        self.schedulers, self.groups, self.policies = schedulers, groups, policies
        self.rank_groups = rank_groups
        self.dp_size = max(rank_groups) + 1
        self.exchange = exchange
        self.counters = [dict.fromkeys(COUNTERS, 0) for _ in schedulers]
        self.attempts = 0                       # next_batch rounds so far, a step or not (replays line up on them)
        self.log: list[StepEntry] | None = None     # verify and tests set a list
        self._peak = 0

    @property
    def peak_running(self) -> int:
        """The most requests running at once over the DP groups, counted as each step's batches formed."""
        if self.dp_size == 1:       # the one group's scheduler counts it at the same point; no sum to keep
            return self.schedulers[0].stats["max_running_requests"]
        return self._peak

    # -- one step ---------------------------------------------------------------------------------------------
    def start(self, executor: Executor) -> StepPlan | None:
        """Form the next step and run its forward through `executor`. None: no step (no group has tokens, or this
        rank sits it out)."""
        self.attempts += 1
        batches, bids = [], []
        for sched in self.schedulers:
            batch = sched.next_batch()
            batches.append(batch)
            bids.append(self._bid(sched, batch))
        if self.exchange is not None:
            bids = self.exchange(bids)
        if bids is None or not any(b.tokens for b in bids):
            return None
        graphable = all(b.graphable for b in bids)
        idle = [b is None for b in batches]
        if True in idle:
            batches = [ForwardBatch.idle() if b is None else b for b in batches]
        decisions = self._decide(batches, bids, graphable)
        self._record(bids, batches, decisions, idle, graphable, 1)
        plan = StepPlan(batches, decisions)
        executor.execute(plan)
        return plan

    def finish(self, plan: StepPlan, now: float) -> list[Req]:
        """The step's sampled tokens to each group (at `now`). Returns the requests that got one."""
        out: list[Req] = []
        for sched, batch, tokens in zip(self.schedulers, plan.batches, plan.tokens):
            out += sched.process(batch, tokens, now)
        return out

    def _bid(self, sched: Scheduler, batch: ForwardBatch | None) -> StepBid:
        if batch is None:
            return NO_BID
        decode = batch.mode.is_decode()
        tokens = len(batch.reqs) if decode else sum(batch.extend_lens)
        return StepBid(tokens, decode, self._running(sched))

    def _running(self, sched: Scheduler) -> int:
        # one group and no log: the scheduler's own peak serves, and the decode step's hot path skips the count
        return sched.num_running() if self.dp_size > 1 or self.log is not None else 0

    def _decide(self, batches: list, bids: list[StepBid], graphable: bool) -> list[Decision]:
        counts = [bids[g].tokens for g in self.rank_groups]      # every rank's: its DP group's tokens
        for batch in batches:
            batch.global_num_tokens, batch.can_run_graph = counts, graphable
        return [policy.decide(batch) for policy, batch in zip(self.policies, batches)]

    def _record(self, bids: list[StepBid], batches: list, decisions: list[Decision], idle: list[bool],
                graphable: bool, steps: int) -> None:
        for counters, policy, decision, was_idle in zip(self.counters, self.policies, decisions, idle):
            counters["steps"] += steps
            counters["idle_steps"] += steps * was_idle
            counters["graph_eligible_steps"] += steps * graphable
            policy.count(decision, steps)
        running = bids[0].running if len(bids) == 1 else sum(b.running for b in bids)
        if running > self._peak:
            self._peak = running
        if self.log is not None:
            groups = tuple(GroupStep(g, b.mode.value, bids[g].tokens, len(b.reqs),
                                     "replay" if d.reason is None else d.reason)
                           for g, b, d in zip(self.groups, batches, decisions))
            self.log += [StepEntry(groups, tuple(b.tokens for b in bids), graphable, running)] * steps

    # -- runs of plain decode steps (the simulator advances them in one event) -----------------------------------
    def run_ahead(self) -> int:
        """Steps from here certain to be plain DECODE steps of every group with work (a group without any idles
        through them), each with the same graph decisions; 0 when the next step may differ. The last of them may
        finish requests."""
        ahead = [s.decode_steps_ahead() for s in self.schedulers if s.has_work()]
        if not ahead or min(ahead) == 0:
            return 0
        k = min(ahead)
        for sched, policy in zip(self.schedulers, self.policies):
            if policy.captured and sched.running:     # a context outgrowing the graphs' width changes the decision
                longest = max(r.kv_len for r in sched.running) + 1
                if longest <= policy.width:
                    k = min(k, policy.width - longest + 1)
        return k

    def run_decisions(self) -> list[Decision]:
        """Each group's graph decision through the coming run (run_ahead keeps it constant)."""
        batches = [_RunBatch(s) for s in self.schedulers]
        return self._decide(batches, [StepBid(len(b.reqs), True, 0) for b in batches], True)

    def advance(self, k: int, tokens: Callable[[Req, int], list[int]], end: float) -> list[Req]:
        """Run k DECODE steps (k <= run_ahead()), the last ending at `end`: the effects, counters and log of k
        steps one by one. tokens(req, n): the request's next n tokens. Returns the requests of the run (each got k
        tokens; the last step may have finished some)."""
        batches = [_RunBatch(s) for s in self.schedulers]
        bids = [StepBid(len(b.reqs), True, self._running(s) if b.reqs else 0)
                for s, b in zip(self.schedulers, batches)]
        idle = [not b.reqs for b in batches]
        self._record(bids, batches, self._decide(batches, bids, True), idle, True, k)
        self.attempts += k
        out: list[Req] = []
        for sched, was_idle in zip(self.schedulers, idle):
            if was_idle:                 # an idle group's state after one IDLE step is a fixed point
                sched.next_batch()
                sched.process(ForwardBatch.idle(), None, end)
            else:
                out += sched.advance_decode(k, tokens, end)
        return out


class _RunBatch:
    """What the graph decision and the log read of a group's next step in a run: its DECODE batch (the requests and
    their lengths after the step), or IDLE for a group without work. No tensors: the simulator's hot path."""

    def __init__(self, sched: Scheduler):
        busy = sched.has_work()
        self.mode = ForwardMode.DECODE if busy else ForwardMode.IDLE
        self.reqs = sched.running if busy else []
        self.seq_lens_cpu = [r.kv_len + 1 for r in self.reqs]
        self.global_num_tokens, self.can_run_graph = None, True


def instance_log(rank_logs: list[list[StepEntry]], leaders: list[int]) -> list[StepEntry]:
    """The instance's step log from its ranks' (rank order): each step's entry with every DP group's part, from
    each group's first rank (`leaders`). ValueError when the ranks did not step in lockstep."""
    if len({len(log) for log in rank_logs}) != 1:
        raise ValueError(f"the ranks ran different numbers of steps: {[len(log) for log in rank_logs]}")
    out = []
    for i, entries in enumerate(zip(*rank_logs)):
        shared = {(e.tokens, e.graph_eligible, e.running) for e in entries}
        if len(shared) != 1:
            raise ValueError(f"step {i}: the ranks saw different bids: {sorted(shared)}")
        first = entries[0]
        groups = tuple(g for r in leaders for g in entries[r].groups)
        out.append(StepEntry(groups, first.tokens, first.graph_eligible, first.running))
    return out
