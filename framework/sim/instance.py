"""A simulated engine instance: the real schedulers (one per DP group, as the parallelism plugin lays the instance
out), the real radix caches and the real KV accounting (counting pools sized by the same memory plan as the engine:
`engine.mem_budget_mb` less the plugins' declared weight bytes), and no forward pass: a step's duration comes from
the cost model and its tokens are synthetic and deterministic (each request's answer is drawn from its id:
`sim.answers`, framework/sim/answers.py).

The step is the engine's own (framework/engine/step.py, which the ranks run too): every group forms its next batch; no
group has one -> no step; a group without a batch while others have one runs an IDLE step; graph decisions, the peak
and the counters as the ranks make them. Its executor here is the cost model (`CostExecutor`), on a virtual clock.
`run_ahead` gives how many of the coming steps are certain to be plain DECODE steps of every busy group, so the
simulator can advance them in one event (`advance`), with exactly the decisions and times of stepping one by one.
"""
from __future__ import annotations

from framework.engine.cuda_graph import GraphPolicy
from framework.engine.engine import plan_memory
from framework.engine.kv_pool import CountingKVPool
from framework.engine.request import Req
from framework.engine.scheduler import Scheduler
from framework.engine.stats import STEP_CPU_KEYS, instance_stats, rank_snapshot, step_cpu_key
from framework.engine.step import InstanceStep, StepPlan
from framework.model.tokenizer import ByteTokenizer
from framework.core.registry import MOE, PARALLELISM
from framework.contracts.routing import LoadReport
from framework.contracts.cost import Step, batch_shape
from framework.sim.answers import answer_source


class SimInstance:
    def __init__(self, name: str, cfg, cost_model, seed: int = 0, http: bool = False):
        """cfg: the run's RootConfig (model, engine, parallel, moe). http: an HTTP worker's instance; with one rank
        its serving work (`cost_model.serving_host_s`) runs in series with its steps, in its one process (a
        multi-rank worker's ranks are processes of their own: its HTTP side runs beside them, not priced)."""
        self.name, self.cost, self.seed = name, cost_model, seed
        self.request_host_s, self.token_host_s = (cost_model.serving_host_s() if http and cfg.parallel.size == 1
                                                  else (0.0, 0.0))
        self.host_pending_s = 0.0            # serving work of the requests that arrived since the last step
        par_cls, moe_cls = PARALLELISM.get(cfg.parallel.name), MOE.get(cfg.moe.name)
        self.par_cls, self.par_cfg = par_cls, cfg.parallel
        self.memory = plan_memory(cfg.model, cfg.engine, par_cls, cfg.parallel, moe_cls, cfg.moe)
        self.tokenizer = ByteTokenizer(cfg.model.vocab_size)
        self.size = cfg.parallel.size
        dp_size = par_cls.dp_size(cfg.parallel)
        self.groups = [Scheduler(cfg.engine, CountingKVPool(self.memory.kv_tokens), self.tokenizer.eos_token_id,
                                 self.tokenizer.decode, par_cls.conservativeness(cfg.parallel),
                                 context_len=cfg.model.max_position_embeddings)
                       for _ in range(dp_size)]
        self.dispatcher = par_cls.make_dispatcher(cfg.parallel)
        for rank, group in enumerate(self.groups):   # dp_balance=precise follows each group's KV events
            self.dispatcher.watch(rank, group.cache)
        self.answers: dict[str, list[int]] = {}
        self.answer_tokens = answer_source(cfg)      # sim.answers: f(seed, rid, n), each answer's ids
        # CUDA graphs as the engine's GraphRunner decides them; captured only where the priced hardware has them
        graphs = cfg.engine.cuda_graph and cost_model.cuda_graphs
        width = min(cfg.model.max_position_embeddings, self.memory.kv_tokens)   # the req_to_token rows' width
        policies = [GraphPolicy(cfg.engine, dp_size > 1, g.max_running, width, graphs) for g in self.groups]
        self.step = InstanceStep(self.groups, list(range(dp_size)),
                                 [par_cls.dp_rank_of(cfg.parallel, r) for r in range(self.size)], policies)
        self.executor = CostExecutor(cost_model, self.answers, self._forward_done)
        self.forward_s = 0.0
        self.step_cpu = [dict.fromkeys(STEP_CPU_KEYS, 0.0) for _ in range(dp_size)]   # per DP group: priced, by kind
        self.step_kind = "decode_cpu_s"     # the last step's kind (STEP_CPU_KEYS): how the host prices its sharing
        # EPLB's weight moves as the cost model prices them (`placement_moves`): forward passes so far, and the
        # moves' counters over them (the real path's MoEBackend.stats keys; absent when no experts are placed)
        self.forward_passes, self.placement = 0, {}
        self._plan: StepPlan | None = None    # the step in flight

    # -- requests ---------------------------------------------------------------------------------------------
    def add(self, req: Req, dp_rank: int | None = None) -> None:
        """Queue a request on the DP group the dispatcher picks (`dp_rank`: a pin, as the engine's Add carries;
        ValueError when it can never run there)."""
        group = self.groups[self.dispatcher.assign(dp_rank, req.prompt_ids)]   # the loads it sees: the last step's, as the engine's
        group.add(req)
        self.host_pending_s += self.request_host_s
        self.answers[req.rid] = self.answer_tokens(self.seed, req.rid, req.params.max_new_tokens)

    def add_paired(self, req: Req) -> None:
        """Queue a request that carries a prefill/decode pairing on its role's path (framework/engine/disagg.py): a
        prefill instance runs it with max_new_tokens 1 and holds its KV; a decode instance pre-allocates its slots."""
        group = self.groups[self.dispatcher.assign(None, req.prompt_ids)]
        self.answers[req.rid] = self.answer_tokens(self.seed, req.rid, req.params.max_new_tokens)
        group.add_paired(req)
        self.host_pending_s += self.request_host_s

    def has_work(self) -> bool:
        return any(g.has_work() for g in self.groups)

    def load(self) -> int:
        return sum(g.num_requests() for g in self.groups)

    def load_report(self) -> LoadReport:
        """What the worker's GET /get_load says (framework/serving/worker.py), summed over the DP groups."""
        groups = self.groups
        held = sum(g.pool.used() for g in groups) - sum(g.cache.total_size() for g in groups)
        return LoadReport(sum(g.num_running() for g in groups), sum(len(g.waiting) for g in groups), max(held, 0))

    # -- one step ---------------------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        """Form the next step's batches; returns its duration (None: no step, the instance is idle). A round that
        forms no batch while requests wait is followed at once by another, as the engine's loop steps again while it
        has work (a batch that just emptied lets the waiting ones in only at the next round)."""
        for _ in range(2):
            t = self.try_step()
            if t is not None or not self.has_work():
                return t
        return None

    def try_step(self) -> float | None:
        """One round of the instance step (as one rank loop iteration makes it): its duration, None for no step."""
        if len(self.groups) > 1:             # one group: every request goes to it
            self.dispatcher.update([g.num_requests() for g in self.groups])
        plan = self.step.start(self.executor)
        if plan is None:
            return None
        self._plan = plan
        self.forward_s += plan.seconds
        for spent, batch in zip(self.step_cpu, plan.batches):   # each group's ranks spend the step, as it counts there
            spent[step_cpu_key((batch,))] += plan.seconds
        self.step_kind = step_cpu_key(plan.batches)             # the step's kind on the host (framework/sim/cluster.py)
        # the serving work of the arrivals since the last step before it, and of the tokens it samples after it
        pending, self.host_pending_s = self.host_pending_s, 0.0
        if self.token_host_s:
            pending += self.token_host_s * sum(sum(b.sample) for b in plan.batches)
        return plan.seconds + pending

    def finish_step(self, now: float) -> list[Req]:
        """The step in flight ends at `now`: every group takes its tokens. Returns the requests that got one."""
        out = self.step.finish(self._plan, now)
        self._plan = None
        self._forget_finished(out)
        return out

    def _forget_finished(self, reqs: list[Req]) -> None:
        for r in reqs:
            if r.finished:
                del self.answers[r.rid]

    # -- runs of decode steps ---------------------------------------------------------------------------------
    def run_ahead(self) -> int:
        """Steps from here certain to be plain DECODE steps of every group with work (a group without any idles
        through them); 0 when the next step may differ. The last of them may finish requests."""
        if any(g.disagg is not None and g.disagg.waiting_slots for g in self.groups):
            return 0           # a decode instance pre-allocates slots at each step: step one at a time meanwhile
        if self.host_pending_s:
            return 0           # serving work of arrivals goes into the next step: price it one step at a time
        return self.step.run_ahead()

    def run_times(self, k: int) -> list[float]:
        """The durations of the next k steps, all DECODE (k <= run_ahead()), a rebalance's stall included."""
        groups = [g if g.has_work() else None for g in self.groups]
        sizes = tuple(len(g.running) if g else 0 for g in groups)
        contexts = tuple(sum(r.kv_len for r in g.running) if g else 0 for g in groups)
        outputs = tuple(sum(len(r.output_ids) for r in g.running) if g else 0 for g in groups) \
            if self.cost.reads_outputs else None
        graph = all(d.reason is None for d in self.step.run_decisions())
        times = self.cost.decode_times(sizes, contexts, k, graph=graph, outputs=outputs)
        n = self.forward_passes
        return [t + self.cost.placement_moves(n + i).get("eplb_stall_s", 0.0) for i, t in enumerate(times, 1)]

    def run_host_s(self) -> float:
        """The serving work each step of a run adds in series (run_ahead: no arrival's waits): its tokens'."""
        return self.token_host_s * sum(len(g.running) for g in self.groups)

    def advance(self, k: int, times: list[float], end: float) -> list[Req]:
        """Run k DECODE steps priced `times` (run_times': unstretched by a shared host), the last ending at `end`
        (the same effects as k start_step/finish_step rounds). Returns the requests of the run (each got k tokens;
        the last step may have finished some)."""
        if len(self.groups) > 1:
            self.dispatcher.update([g.num_requests() for g in self.groups])
        answers = self.answers
        out = self.step.advance(k, lambda r, n: answers[r.rid][len(r.output_ids):len(r.output_ids) + n], end)
        self.forward_s += sum(times)         # run_times priced the stalls: only count the moves here
        for spent in self.step_cpu:
            for t in times:                  # one at a time: the very sum of stepping one by one
                spent["decode_cpu_s"] += t
        for _ in range(k):
            self._forward_done()
        self._forget_finished(out)
        return out

    def _forward_done(self) -> float:
        """A forward pass ended: count what EPLB moved at its end; the seconds serving stopped for it."""
        self.forward_passes += 1
        moves = self.cost.placement_moves(self.forward_passes)
        for key, value in moves.items():
            self.placement[key] = self.placement.get(key, 0) + value
        return moves.get("eplb_stall_s", 0.0)

    # -- stats ------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The instance's stats, in the engine's own format (framework.engine.stats): each rank counts as the ranks
        of its DP group do."""
        scheme = self.par_cls.describe(self.par_cfg)
        ranks = []
        for rank in range(self.size):
            dp = self.par_cls.dp_rank_of(self.par_cfg, rank)
            leads = rank == 0 or self.par_cls.dp_rank_of(self.par_cfg, rank - 1) != dp
            counters = {**self.step.counters[dp], **self.step.policies[dp].stats, "forward_s": self.forward_s,
                        "schedule_s": 0.0, "skipped_idle_steps": 0, **self.step_cpu[dp], **self.placement}
            ranks.append(rank_snapshot(self.groups[dp], scheme, rank, dp, leads, self.memory,
                                       self.dispatcher.assigned[dp], counters))
        return instance_stats(ranks, self.step.peak_running)


class CostExecutor:
    """The simulator's executor of a step: the cost model prices its batches (the forward's seconds on the virtual
    clock) and each sampled request takes its next deterministic answer token."""

    def __init__(self, cost_model, answers: dict[str, list[int]], forward_done=lambda: 0.0):
        """forward_done(): called once per step, after it; returns the seconds the step stalls after its forward
        (an EPLB rebalance moving weights: SGLang's ModelRunner runs it at the end of the pass)."""
        self.cost, self.answers, self.forward_done = cost_model, answers, forward_done

    def execute(self, plan: StepPlan) -> None:
        graph = all(d.reason is None for d in plan.decisions)
        outputs = self.cost.reads_outputs
        plan.seconds = self.cost.step_time(Step(tuple(batch_shape(b, outputs) for b in plan.batches), graph=graph))
        plan.seconds += self.forward_done()
        answers = self.answers
        plan.tokens = [[answers[r.rid][len(r.output_ids)] for r, s in zip(b.reqs, b.sample) if s]
                       for b in plan.batches]
