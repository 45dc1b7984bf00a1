"""Splitwise's pair choice for its prompt and token pools (Patel et al., ISCA'24; the authors' simulator
Mutinifni/splitwise-sim at 8f99e7d, ``MixedPoolScheduler``, scheduler.py:579-735, the scheduler of every Splitwise
design: scripts/run_isopower.sh and run_throughput_isopower.sh ``applications.0.scheduler=mixed_pool``,
configs/orchestrator_repo/schedulers/mixed_pool.yml). It picks by the role it is asked for (``select_pair``, or one
policy instance per role as the router core keeps them):

- a prompt machine (role ``prefill``): the fewest pending prompt tokens (``find_best_prompt_instance``,
  scheduler.py:635-636; ties: the first added), credited with the prompt's tokens (scheduler.py:734) until its first
  token (task.py:138): ``on_first_token``, else when its attempt ends;
- a token machine (role ``decode``): the least KV memory reserved (``find_best_token_instance``, scheduler.py:647-648,
  ``sched_memory``: the same weights on every machine, so the least reserved KV; ties: the first added), credited
  with the prompt's tokens and the request's whole output (scheduler.py:723-724: ``PromptTask.max_memory`` is
  prompt_size + 1 tokens of KV, task.py:109-112, ``TokenTask.max_memory`` its token_size, task.py:178-181, which is
  the request's output less the first token, request.py:250: prompt + output in all) until the
  request ends (task.py:216-217 frees the request's memory, instance.py:110 takes it off ``sched_memory``). The
  output is the request's ``max_new_tokens`` (``RequestView``: the simulator gives it; a caller that does not counts
  none);
- no role (one pool of mixed machines): Splitwise's fallback to mixed batching (scheduler.py:709-714, 729-735): the
  fewest pending tokens, credited with the prompt plus one, as token_jsq (both count through
  plugins/routing/lib/pending_tokens.py).

Not built: lending. Splitwise moves a token machine into a mixed pool when the least-loaded prompt machine has a
queue and its pending prompt tokens with this prompt would pass ``prompt_max_pending_batch_tokens`` (8,192,
``is_queue_long``, scheduler.py:619-627, 693-699), and a prompt machine when the least-loaded token machine's
reserved memory with this request would reach its capacity (``is_memory_loaded``, scheduler.py:610-617, 701-707),
until the lent machine is idle (``notify_free_instance``, scheduler.py:653-666; instance.py:488-490). servelab's
instances keep their roles, so here the machine chosen by the rule above takes the request all the same, and the
decision's reason says that Splitwise would have lent one: ``prompt_queue_long`` (the queue is taken as "prompt tokens
pending", since the router does not see the machine's waiting queue) or ``token_memory_full`` (checked only when
``kv_capacity_tokens`` > 0: a machine's KV capacity, (memory - weights) / KV bytes per token). The counts lending
alone reads are not kept: a token machine's one pending token a request (scheduler.py:735) and a prompt machine's
reserved memory (scheduler.py:722, freed when the KV is sent, flow.py:74).
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestUsage, RequestView, RoutingConfig, RoutingDecision
from plugins.routing.lib.pending_tokens import Pending, PendingTokensPolicy, prompt_size


@dataclass
class MixedPoolConfig(RoutingConfig):
    name: str = "mixed_pool"
    prompt_max_pending_batch_tokens: int = 8192   # mixed_pool.yml: past it Splitwise lends a token machine
    kv_capacity_tokens: float = 0.0               # a token machine's KV tokens; 0: its fullness is not checked


@ROUTING.register("mixed_pool")
class MixedPoolRouting(PendingTokensPolicy):
    Config = MixedPoolConfig
    Reasons = ("least_pending_prompt", "prompt_queue_long", "least_memory", "token_memory_full", "mixed_batching")

    def __init__(self, cfg: MixedPoolConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        if self.cfg.prompt_max_pending_batch_tokens < 0 or self.cfg.kv_capacity_tokens < 0:
            raise ValueError(f"router=mixed_pool: prompt_max_pending_batch_tokens="
                             f"{self.cfg.prompt_max_pending_batch_tokens} and kv_capacity_tokens="
                             f"{self.cfg.kv_capacity_tokens} must be >= 0")
        self.reserved: dict[str, int] = {}   # worker -> KV tokens reserved by its requests in flight (sched_memory)

    def _worker_added(self, worker: str) -> None:
        super()._worker_added(worker)
        self.reserved[worker] = 0

    def _worker_removed(self, worker: str) -> None:
        super()._worker_removed(worker)
        self.reserved.pop(worker, None)

    def state_sizes(self) -> dict[str, int]:
        return {**super().state_sizes(), "reserved_workers": len(self.reserved)}

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        if self.role == "prefill":
            d = self.join_shortest(request, candidates, 0, "least_pending_prompt")
            p = d.memo.prompt
            before = self.pending[d.worker] - p
            long = before > 0 and before + p > self.cfg.prompt_max_pending_batch_tokens
            return d._replace(reason="prompt_queue_long") if long else d
        if self.role == "decode":
            p, reserved = prompt_size(request), self.reserved
            worker = min(candidates, key=reserved.__getitem__)   # ties: the first added (scheduler.py's min)
            need = p + max(request.max_new_tokens or 1, 1)   # (p + 1) + (output - 1): request.py:250
            cap = self.cfg.kv_capacity_tokens
            full = cap > 0 and reserved[worker] + need >= cap
            reserved[worker] += need
            return RoutingDecision(worker, 0, p, "token_memory_full" if full else "least_memory",
                                   memo=Pending(0, 0, need))
        return self.join_shortest(request, candidates, 1, "mixed_batching")

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        super()._settle(decision, ok, usage)
        held = decision.memo
        self.reserved[decision.worker] -= held.reserved
        held.reserved = 0
