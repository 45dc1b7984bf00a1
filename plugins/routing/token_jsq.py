"""Splitwise's token join-the-shortest-queue (Patel et al., ISCA'24; the authors' simulator Mutinifni/splitwise-sim at
8f99e7d, ``TokenJSQScheduler``, the scheduler of its Baseline designs: scripts/run_throughput_isopower.sh
``applications.0.scheduler=token_jsq``, configs/orchestrator_repo/schedulers/token_jsq.yaml).

Each worker has a count of pending tokens (splitwise-sim's ``Instance.sched_pending_tokens``, instance.py:69):

- a request goes to the candidate with the fewest (scheduler.py:370-371, Python's ``min``: ties go to the first,
  here the first added), which is credited with its prompt's tokens plus one (scheduler.py:379);
- the prompt's tokens come off when its prompt phase ends, at its first token (task.py:138, ``PromptTask.complete``):
  ``on_first_token``;
- the one comes off when the request ends (task.py:206, ``TokenTask.complete``): ``on_request_done``.

The counts are plugins/routing/lib/pending_tokens.py's (shared with mixed_pool): a request whose first token the
policy was not told of (the attempt failed, or the caller does not make the call: servelab's real P/D path and the
``router.dp_aware`` wrapper do not) gives its prompt's tokens back when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from framework.core.registry import ROUTING
from framework.contracts.routing import RequestView, RoutingConfig, RoutingDecision
from plugins.routing.lib.pending_tokens import PendingTokensPolicy


@dataclass
class TokenJsqConfig(RoutingConfig):
    name: str = "token_jsq"


@ROUTING.register("token_jsq")
class TokenJsqRouting(PendingTokensPolicy):
    Config = TokenJsqConfig
    Reasons = ("least_pending_tokens",)

    def _decide(self, request: RequestView, candidates: list[str]) -> RoutingDecision:
        return self.join_shortest(request, candidates, 1, "least_pending_tokens")   # prompt_size + 1 (scheduler.py:379)
