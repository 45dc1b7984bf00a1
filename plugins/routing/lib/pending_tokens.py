"""Splitwise's pending-token counts (the authors' simulator Mutinifni/splitwise-sim at 8f99e7d,
``Instance.sched_pending_tokens``, instance.py:69), shared by its schedulers' policies (plugins/routing/token_jsq.py,
mixed_pool.py): per worker, the tokens of the requests sent to it that it has not served yet. A request's own share
rides on its decision (``Pending``): its prompt's tokens come off at its first token (``on_first_token``; task.py:138),
the rest when it ends; a request whose first token the policy was not told of gives its prompt back at its end, so the
counts stay exact and bounded. One count per worker, dropped with the worker; a flush or restart leaves it (it counts
requests in flight, which end as they end)."""
from __future__ import annotations

from framework.contracts.routing import RequestUsage, RequestView, RoutingDecision, RoutingPolicy


class Pending:
    """What one request still counts on its worker: ``prompt`` tokens until its first token, ``tail`` until it ends
    (and, for mixed_pool's token machines, ``reserved`` KV tokens until it ends)."""
    __slots__ = ("prompt", "tail", "reserved")

    def __init__(self, prompt: int, tail: int, reserved: int = 0):
        self.prompt, self.tail, self.reserved = prompt, tail, reserved


def prompt_size(request: RequestView) -> int:
    """The request's prompt tokens: its token ids, else its UTF-8 bytes."""
    return len(request.token_ids) if request.token_ids is not None else len(request.text.encode("utf-8"))


class PendingTokensPolicy(RoutingPolicy):
    """A policy that keeps ``pending`` tokens per worker; subclasses decide (``_decide``), crediting through
    ``join_shortest``."""

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        self.pending: dict[str, int] = {}   # worker -> pending tokens (sched_pending_tokens)

    def _worker_added(self, worker: str) -> None:
        self.pending[worker] = 0

    def _worker_removed(self, worker: str) -> None:
        self.pending.pop(worker, None)   # its requests in flight end without reaching the policy

    def _worker_reset(self, worker: str, cause: str) -> None:
        pass                             # the count is of requests in flight, not of the cache

    def state_sizes(self) -> dict[str, int]:
        return {"pending_workers": len(self.pending)}

    def join_shortest(self, request: RequestView, candidates: list[str], tail: int, reason: str) -> RoutingDecision:
        """The candidate with the fewest pending tokens (ties: the first added, as scheduler.py's ``min``), credited
        with the request's prompt until its first token and ``tail`` more until it ends."""
        p, pending = prompt_size(request), self.pending
        worker = min(candidates, key=pending.__getitem__)
        pending[worker] += p + tail
        return RoutingDecision(worker, 0, p, reason, memo=Pending(p, tail))

    def on_first_token(self, worker: str, decision: RoutingDecision) -> None:
        held = decision.memo
        if held.prompt and worker in self.pending:
            self.pending[worker] -= held.prompt
            held.prompt = 0

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        held = decision.memo
        self.pending[decision.worker] -= held.prompt + held.tail
        held.prompt = held.tail = 0
