"""A simulated engine instance: the real schedulers (one per DP group, as the parallelism plugin lays the instance
out), the real radix caches and the real KV accounting (counting pools sized by the same memory plan as the engine:
`engine.mem_budget_mb` less the plugins' declared weight bytes), and no forward pass: a step's duration comes from
the cost model and its tokens are synthetic and deterministic (each request's answer is drawn from its id).

The step protocol is the engine's (framework/instance/rank_loop.py + the parallelism plugin's sync_step): every group
forms its next batch; no group has one -> no step; a group without a batch while others have one runs an IDLE step.
`run_ahead` gives how many of the coming steps are certain to be plain DECODE steps of every busy group, so the
simulator can advance them in one event (`advance`), with exactly the decisions and times of stepping one by one.
"""
from __future__ import annotations

import random

from framework.contracts.batch import ForwardBatch, ForwardMode
from framework.engine.cuda_graph import GRAPH_COUNTERS, SGLANG_DP_ATTENTION_MAX_BS, SGLANG_MAX_BS, capture_sizes
from framework.engine.engine import plan_memory
from framework.engine.kv_pool import CountingKVPool
from framework.engine.request import Req
from framework.engine.scheduler import Scheduler
from framework.engine.stats import instance_stats, rank_snapshot
from framework.model.tokenizer import ByteTokenizer
from framework.core.registry import MOE, PARALLELISM
from framework.contracts.routing import LoadReport
from framework.contracts.cost import BatchShape, Step, decode_shape

# printable ASCII: an answer's text has as many bytes as tokens, and never an EOS
_PRINTABLE = bytes(32 + b % 95 for b in range(256))


def answer_tokens(seed: int, rid: str, n: int) -> list[int]:
    """The deterministic answer of request `rid`: n printable byte tokens."""
    return list(random.Random(f"{seed}/{rid}").randbytes(n).translate(_PRINTABLE))


class SimInstance:
    def __init__(self, name: str, cfg, cost_model, seed: int = 0):
        """cfg: the run's RootConfig (model, engine, parallel, moe)."""
        self.name, self.cost, self.seed = name, cost_model, seed
        par_cls, moe_cls = PARALLELISM.get(cfg.parallel.name), MOE.get(cfg.moe.name)
        self.par_cls, self.par_cfg = par_cls, cfg.parallel
        self.memory = plan_memory(cfg.model, cfg.engine, par_cls, cfg.parallel, moe_cls, cfg.moe)
        self.tokenizer = ByteTokenizer(cfg.model.vocab_size)
        self.size = cfg.parallel.size
        self.groups = [Scheduler(cfg.engine, CountingKVPool(self.memory.kv_tokens), self.tokenizer.eos_token_id,
                                 self.tokenizer.decode, par_cls.conservativeness(cfg.parallel),
                                 context_len=cfg.model.max_position_embeddings)
                       for _ in range(par_cls.dp_size(cfg.parallel))]
        self.dispatcher = par_cls.make_dispatcher(cfg.parallel)
        self.answers: dict[str, list[int]] = {}
        self.counters = {"steps": 0, "idle_steps": 0, "graph_eligible_steps": 0, "forward_s": 0.0,
                         **dict.fromkeys(GRAPH_COUNTERS, 0)}
        # CUDA graphs as the engine's GraphRunner decides them; captured only where the priced hardware has them
        e = cfg.engine
        max_bs = e.cuda_graph_max_bs or (SGLANG_DP_ATTENTION_MAX_BS if len(self.groups) > 1 else SGLANG_MAX_BS)
        self.graph_max_bs = capture_sizes(max_bs, list(e.cuda_graph_bs), self.groups[0].max_running)[-1]
        self.graph_width = min(e.cuda_graph_max_context, cfg.model.max_position_embeddings, self.memory.kv_tokens)
        self.graphs = e.cuda_graph and cost_model.cuda_graphs
        self.peak_running = 0
        self._batches: list[ForwardBatch | None] | None = None    # the step in flight

    # -- requests ---------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a request on the DP group the dispatcher picks (ValueError when it can never run there)."""
        group = self.groups[self.dispatcher.assign()]   # the loads it sees: the last step's, as the engine's
        group.add(req)
        self.answers[req.rid] = answer_tokens(self.seed, req.rid, req.params.max_new_tokens)

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
            t = self._try_step()
            if t is not None or not self.has_work():
                return t
        return None

    def _try_step(self) -> float | None:
        multi = len(self.groups) > 1
        if multi:                                # one group: every request goes to it, its peak is its own
            self.dispatcher.update([g.num_requests() for g in self.groups])
        batches = [g.next_batch() for g in self.groups]
        if all(b is None for b in batches):
            return None
        self._batches = batches
        shapes = tuple(_shape(b) for b in batches)
        eligible = all(b is None or b.mode.is_decode() for b in batches)
        reason = self._graph_reason(batches, eligible)
        self._count(1, sum(b is None for b in batches), eligible, reason)
        if multi:
            self.peak_running = max(self.peak_running, sum(g.num_running() for g in self.groups))
        t = self._step_time(shapes, reason is None)
        self.counters["forward_s"] += t
        return t

    def _graph_reason(self, batches: list, eligible: bool) -> str | None:
        """Why the step runs eagerly (GraphRunner.decide, as rank 0 sees it), None when it replays a graph."""
        first = batches[0]
        if first is not None and not first.mode.is_decode():
            return "mode"
        if not eligible:
            return "disagree"
        if max(len(b.reqs) if b else 0 for b in batches) > self.graph_max_bs:
            return "size"
        if not self.graphs:
            return "off"
        if max(max(b.seq_lens_cpu) if b else 0 for b in batches) > self.graph_width:
            return "context"
        return None

    def _count(self, steps: int, idle: int, eligible: bool, reason: str | None) -> None:
        c = self.counters
        c["steps"] += steps
        c["idle_steps"] += idle
        c["graph_eligible_steps"] += steps if eligible else 0
        c["graph_replayed_steps" if reason is None else "graph_eager_steps"] += steps
        if reason is not None:
            c[f"graph_eager_{reason}_steps"] += steps

    def finish_step(self, now: float) -> list[Req]:
        """The step in flight ends at `now`: every group takes its tokens. Returns the requests that got one."""
        out: list[Req] = []
        for g, b in zip(self.groups, self._batches):
            if b is None:
                g.process(ForwardBatch.idle(), None, now)
                continue
            sampled = [r for r, s in zip(b.reqs, b.sample) if s]
            out += g.process(b, [self.answers[r.rid][len(r.output_ids)] for r in sampled], now)
        self._batches = None
        for r in out:
            if r.finished:
                del self.answers[r.rid]
        return out

    # -- runs of decode steps ---------------------------------------------------------------------------------
    def run_ahead(self) -> int:
        """Steps from here certain to be plain DECODE steps of every group with work (a group without any idles
        through them); 0 when the next step may differ. The last of them may finish requests."""
        ahead = [g.decode_steps_ahead() if g.has_work() else None for g in self.groups]
        busy = [a for a in ahead if a is not None]
        if not busy or min(busy) == 0:
            return 0
        longest = max(r.kv_len + 1 for g in self.groups for r in g.running)
        if self.graphs and longest <= self.graph_width:   # a run stays on one side of the graphs' context width
            return min(min(busy), self.graph_width - longest + 1)
        return min(busy)

    def _run_reason(self) -> str | None:
        """The graph decision of every step of a run (constant through it: run_ahead keeps it so)."""
        batches = [_RunBatch(g.running) if g.has_work() else None for g in self.groups]
        return self._graph_reason(batches, True)

    def run_times(self, k: int) -> list[float]:
        """The durations of the next k steps, all DECODE (k <= run_ahead())."""
        groups = [g if g.has_work() else None for g in self.groups]
        sizes = tuple(len(g.running) if g else 0 for g in groups)
        contexts = tuple(sum(r.kv_len for r in g.running) if g else 0 for g in groups)
        return self.cost.decode_times(sizes, contexts, k, graph=self._run_reason() is None)

    def advance(self, k: int, times: list[float], end: float) -> list[Req]:
        """Run k DECODE steps of the given durations, the last ending at `end` (the same effects as k
        start_step/finish_step rounds). Returns the requests of the run (each got k tokens; the last step may have
        finished some)."""
        out: list[Req] = []
        busy = 0
        if len(self.groups) > 1:
            self.dispatcher.update([g.num_requests() for g in self.groups])
            self.peak_running = max(self.peak_running, sum(g.num_running() for g in self.groups))
        reason = self._run_reason()
        answers = self.answers
        for g in self.groups:
            if not g.has_work():                 # an idle group's state after one IDLE step is a fixed point
                g.next_batch()
                g.process(ForwardBatch.idle(), None, end)
                continue
            busy += 1
            out += g.advance_decode(k, lambda r, n: answers[r.rid][len(r.output_ids):len(r.output_ids) + n], end)
        self._count(k, k * (len(self.groups) - busy), True, reason)
        self.counters["forward_s"] += sum(times)
        for r in out:
            if r.finished:
                del self.answers[r.rid]
        return out

    # -- costs ------------------------------------------------------------------------------------------------
    def _step_time(self, shapes: tuple[BatchShape, ...], graph: bool) -> float:
        return self.cost.step_time(Step(shapes, graph=graph))
    # -- stats ------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The instance's stats, in the engine's own format (framework.engine.stats)."""
        scheme = self.par_cls.describe(self.par_cfg)
        ranks = []
        for rank in range(self.size):
            dp = self.par_cls.dp_rank_of(self.par_cfg, rank)
            leads = rank == 0 or self.par_cls.dp_rank_of(self.par_cfg, rank - 1) != dp
            counters = {**self.counters, "schedule_s": 0.0, "skipped_idle_steps": 0,
                        "idle_steps": self.counters["idle_steps"] if rank == 0 else 0}
            ranks.append(rank_snapshot(self.groups[dp], scheme, rank, dp, leads, self.memory,
                                       self.dispatcher.assigned[dp], counters))
        return instance_stats(ranks, self.peak_running if len(self.groups) > 1 else None)


class _RunBatch:
    """What the graph decision reads of a decode batch about to run (its requests and their lengths after it)."""

    def __init__(self, reqs: list[Req]):
        self.reqs, self.seq_lens_cpu = reqs, [r.kv_len + 1 for r in reqs]
        self.mode = ForwardMode.DECODE


def _shape(batch: ForwardBatch | None) -> BatchShape:
    if batch is None:
        return BatchShape()
    if batch.mode.is_decode():
        return decode_shape(len(batch.reqs), sum(batch.seq_lens_cpu) - len(batch.reqs))
    return BatchShape("extend", tuple(batch.extend_lens), tuple(batch.prefix_lens))

