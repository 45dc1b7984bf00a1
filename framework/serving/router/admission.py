"""Admission control with sglang-router 0.3.2's names and semantics (``--max-concurrent-requests``, ``--queue-size``,
``--queue-timeout-secs``, ``--rate-limit-tokens-per-second``; sgl-router src/middleware.rs and core/token_bucket.rs):

- a token bucket of capacity ``max_concurrent_requests``, refilled at ``rate_limit_tokens_per_second`` (default: the
  capacity, per second); a generation request takes a token to be admitted and gives it back when it ends;
- no token: the request waits in a FIFO queue for one, at most ``queue_timeout_secs``, then gets 408 (SGLang's
  status); the queue full (or ``queue_size`` 0): 429 at once;
- ``max_concurrent_requests`` -1 (the default): no limit, nothing is counted.

Where servelab differs (docs/fidelity.md, "Router"): the queue is bounded by ``queue_size`` (SGLang's bounded channel
is drained at once into waiting tasks, so its queue has no bound in practice), a queued request waits for a token
until its own queue timeout (SGLang's waiter gives up after the time one refill takes, ``1 / rate`` s, racing the
refill), and a refusal carries Retry-After and a JSON error (SGLang's has an empty body).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from framework.serving.http.errors import ApiError


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_s: float, rate: float | None,
                 clock=time.monotonic):
        self.enabled = max_concurrent > 0
        self.capacity = float(max(max_concurrent, 0))
        self.rate = float(rate) if rate else max(self.capacity, 1.0)
        self.queue_size, self.queue_timeout_s, self.clock = queue_size, queue_timeout_s, clock
        self.tokens, self._last = self.capacity, clock()
        self.waiting: deque[asyncio.Future] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.in_flight = 0
        self.counts = {"admitted": 0, "queued": 0, "rejected_queue_full": 0, "queue_timeouts": 0}
        self._retry_after = {"Retry-After": str(max(1, math.ceil(1 / self.rate)))}

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = now

    def try_admit(self) -> bool:
        """Admitted at once (then ``release()`` exactly once): True; False when the request would have to queue or
        be refused, which ``admit`` does. Always True when admission control is off (and nothing is counted)."""
        if not self.enabled:
            return True
        self._refill()
        if not self.waiting and self.tokens >= 1.0:
            self.tokens -= 1.0
            self._admitted()
            return True
        return False

    async def admit(self) -> None:
        """Returns once admitted (then ``release()`` exactly once); raises ApiError 429 / 408 when not admitted."""
        if self.try_admit():
            return
        if len(self.waiting) >= self.queue_size:
            self.counts["rejected_queue_full"] += 1
            what = "the admission queue is full" if self.queue_size else "no admission queue (router.queue_size=0)"
            raise ApiError(429, f"too many requests: {self.in_flight} admitted, {what} (router.max_concurrent_requests"
                                f"={self.capacity:g}, router.queue_size={self.queue_size})",
                           type="rate_limit_error", headers=self._retry_after)
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.counts["queued"] += 1
        self._schedule()
        try:
            await asyncio.wait_for(fut, self.queue_timeout_s)
        except TimeoutError:
            self.counts["queue_timeouts"] += 1
            raise ApiError(408, f"request waited {self.queue_timeout_s:g}s in the admission queue without being "
                                f"admitted (router.queue_timeout_secs)", type="rate_limit_error",
                           headers=self._retry_after) from None
        except BaseException:
            if fut.done() and not fut.cancelled():  # admitted as it was cancelled: give the token back
                self.release()
            raise
        finally:
            if fut in self.waiting:
                self.waiting.remove(fut)

    def _admitted(self) -> None:
        self.in_flight += 1
        self.counts["admitted"] += 1

    def release(self) -> None:
        if not self.enabled:
            return
        self.in_flight -= 1
        self._refill()
        self.tokens = min(self.capacity, self.tokens + 1.0)
        self._hand_out()

    def _hand_out(self) -> None:
        """Tokens to the queue's head, in order."""
        self._timer = None
        self._refill()
        while self.waiting and self.tokens >= 1.0:
            fut = self.waiting.popleft()
            if not fut.done():
                self.tokens -= 1.0
                self._admitted()
                fut.set_result(None)
        self._schedule()

    def _schedule(self) -> None:
        """While requests wait, wake when the refill makes the next token."""
        if self.waiting and self._timer is None:
            wait = max(0.0, (1.0 - self.tokens) / self.rate)
            self._timer = asyncio.get_running_loop().call_later(wait, self._hand_out)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "in_flight": self.in_flight, "queued_now": len(self.waiting), **self.counts}
