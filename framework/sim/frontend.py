"""The front end of one server process in the simulation (issue 19, item 3): SGLang v0.4's TokenizerManager, one
per server (shared by every DP rank of an instance under DP attention; one per worker behind a router), with its
DetokenizerManager. One queue, served in order: a request is taken in (HTTP, per request) and tokenized (per prompt
token) before its scheduler sees it, and every streamed chunk (one per `stream_interval` tokens of a request, and its
last) is detokenized and written out before the client gets it (a fixed part and one per token of the request's
output so far, which SGLang's chunk carries whole). The scheduler does not wait for it: a busy front end delays what
the client sees, not the steps.

Its terms are the instance's cost model's (`sim.cost.frontend`, `tokenize_us_per_request`, `tokenize_us_per_token`,
`stream_us_per_chunk`, `stream_us_per_output_token`, `stream_interval`); a cost model without them has no front end.
SGLang's front end is three processes in a row (TokenizerManager with HTTP, DetokenizerManager, and the client's
own); one queue at the slowest one's price gives the throughput they allow, not the latency of the two others.
"""
from __future__ import annotations


class FrontEnd:
    def __init__(self, cost_cfg):
        self.on = bool(getattr(cost_cfg, "frontend", False))
        self.tokenize_s = getattr(cost_cfg, "tokenize_us_per_token", 0.0) * 1e-6
        self.request_s = getattr(cost_cfg, "tokenize_us_per_request", 0.0) * 1e-6   # HTTP in and out, per request
        self.chunk_s = getattr(cost_cfg, "stream_us_per_chunk", 0.0) * 1e-6
        # SGLang's chunk carries the request's whole output so far (text and ids): each costs more as it grows
        self.per_output_s = getattr(cost_cfg, "stream_us_per_output_token", 0.0) * 1e-6
        self.interval = max(int(getattr(cost_cfg, "stream_interval", 1)), 1)
        self.free_at = 0.0
        self.busy_s = 0.0

    def tokenize(self, t: float, tokens: int) -> float:
        """When a request reaching the server at t reaches its scheduler."""
        work = self.request_s + tokens * self.tokenize_s
        return self._serve(t, work) if self.on and work else t

    def stream(self, ends: list[float], reqs: list) -> list[float]:
        """Each request of a step (or a run of decode steps ending at `ends`, every request getting one token per
        step) has its chunks written in order, step by step: when each one's last chunk is out (a finished request's
        last token is always a chunk). Adds one chunk at a time, so a run gives the times of its steps one by one."""
        if not (self.on and (self.chunk_s or self.per_output_s)):
            return [ends[-1]] * len(reqs)
        k, c0, c1, every = len(ends), self.chunk_s, self.per_output_s, self.interval
        out = [ends[-1]] * len(reqs)
        free = self.free_at
        for j, end in enumerate(ends):
            free = max(free, end)
            last, behind = j == k - 1, k - 1 - j          # tokens each request gets after this step
            for i, r in enumerate(reqs):
                n = len(r.output_ids) - behind             # SGLang streams the first token at once
                if n % every == 0 or n == 1 or (last and r.finished):
                    c = c0 + c1 * n
                    free += c
                    self.busy_s += c
                    if last:
                        out[i] = free
        self.free_at = free
        return out

    def _serve(self, t: float, work: float) -> float:
        self.free_at = max(self.free_at, t) + work
        self.busy_s += work
        return self.free_at
