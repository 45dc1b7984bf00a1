"""Splitwise's token join-the-shortest-queue (Patel et al., ISCA'24; the authors' simulator Mutinifni/splitwise-sim at
8f99e7d, ``TokenJSQScheduler``, the scheduler of its Baseline designs: scripts/run_throughput_isopower.sh
``applications.0.scheduler=token_jsq``, configs/orchestrator_repo/schedulers/token_jsq.yaml).

Each worker has a count of pending tokens (splitwise-sim's ``Instance.sched_pending_tokens``, instance.py:69):

- a request goes to the candidate with the fewest (scheduler.py:370-371, Python's ``min``: ties go to the first,
  here the first added), which is credited with its prompt's tokens plus one (scheduler.py:379);
- the prompt's tokens come off when its prompt phase ends, at its first token (task.py:138, ``PromptTask.complete``):
  ``on_first_token``;
- the one comes off when the request ends (task.py:206, ``TokenTask.complete``): ``on_request_done``.

A request whose first token the policy was not told of (the attempt failed, or the caller does not make the call:
servelab's real P/D path and the ``router.dp_aware`` wrapper do not) gives its prompt's tokens back when it ends, so
the counts stay exact and bounded. Prompt tokens: the request's token ids, else its UTF-8 bytes. The policy keeps one
count per worker (dropped with the worker); a request's own share rides on its decision (``memo``).
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestUsage, RequestView, RoutingConfig, RoutingDecision, RoutingPolicy


@dataclass
class TokenJsqConfig(RoutingConfig):
    name: str = "token_jsq"


class Pending:
    """What one request still counts on its worker: ``prompt`` tokens until its first token, ``tail`` until it ends
    (and, for mixed_pool's token machines, ``reserved`` KV tokens until it ends)."""
    __slots__ = ("prompt", "tail", "reserved")

    def __init__(self, prompt: int, tail: int, reserved: int = 0):
        self.prompt, self.tail, self.reserved = prompt, tail, reserved


def prompt_size(request: RequestView) -> int:
    """The request's prompt tokens: its token ids, else its UTF-8 bytes."""
    return len(request.token_ids) if request.token_ids is not None else len(request.text.encode("utf-8"))


@ROUTING.register("token_jsq")
class TokenJsqRouting(RoutingPolicy):
    Config = TokenJsqConfig
    Reasons = ("least_pending_tokens",)

    def __init__(self, cfg: TokenJsqConfig | None = None, seed: int = 0):
        super().__init__(cfg, seed)
        self.pending: dict[str, int] = {}   # worker -> pending tokens (sched_pending_tokens)

    def _worker_added(self, worker: str) -> None:
        self.pending[worker] = 0

    def _worker_removed(self, worker: str) -> None:
        self.pending.pop(worker, None)   # its requests in flight end without reaching the policy

    # a flush or a restart leaves the count alone: it counts requests in flight, which end as they end
    def _worker_reset(self, worker: str, cause: str) -> None:
        pass

    def state_sizes(self) -> dict[str, int]:
        return {"pending_workers": len(self.pending)}

    def least_pending(self, candidates: list[str]) -> str:
        pending = self.pending
        return min(candidates, key=pending.__getitem__)   # ties: the first added (scheduler.py's min)

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        p = prompt_size(request)
        worker = self.least_pending(candidates)
        self.pending[worker] += p + 1
        return RoutingDecision(worker, 0, p, "least_pending_tokens", memo=Pending(p, 1))

    def on_first_token(self, worker: str, decision: RoutingDecision) -> None:
        held = decision.memo
        if held.prompt and worker in self.pending:
            self.pending[worker] -= held.prompt
            held.prompt = 0

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        held = decision.memo
        self.pending[decision.worker] -= held.prompt + held.tail
        held.prompt = held.tail = 0
