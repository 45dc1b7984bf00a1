"""The router's callback path: a non-streamed request driven by the parsers' callbacks, with no task and no await.

Why: on the coroutine path (service.Router.run_call) a proxied request costs a task, a future per wait and the loop
iterations that resume them; at one client that is most of the latency the router adds (experiments/bench_router).
Here the client connection's parser hands the request over (service.Router.on_request), the attempt is written on a
pooled worker connection at once, and that connection's parser hands the whole answer back (``on_complete``), which
goes to the client in the same callback.

Every feature of the coroutine path is kept, as explicit state on this object, through the same Router methods:
the policy's decision and release (the router core), retries with backoff (``_next``; the backoff is a timer, on a
retry only), the client's first-byte and total deadlines (``expiry``, checked by the router's one periodic sweep,
not a timer per request), KV-event holds (``unheld`` from the router's wake-up, a timer for the hold's limit), the
breaker's verdicts, admission released once, the outcome counted once, request ids and the route headers.
What stays on the coroutine path: streamed requests, the admission queue, prefill/decode pairs, a new worker
connection (``connect``: a task, while the pool is empty) and an answer that streams although the request asked
for none (handed to ``Router.relay_attempt`` in a task from its response head).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time

from framework.routing.core import CLIENT_DISCONNECT
from framework.routing.dp_aware import dp_rank_of
from framework.serving.http.errors import ApiError
from framework.serving.router.health import WorkerTimeout
from framework.serving.router.wire import Failed, judged

log = logging.getLogger("framework.serving.router.service")
_NEVER = math.inf


def _guarded(method):
    """A callback of the flight: a bug in it ends the request with a logged 500 instead of leaking its slot."""
    @functools.wraps(method)
    def run(self, *args):
        try:
            method(self, *args)
        except Exception:
            self._crashed()
    return run


class Flight:
    """One client request on the callback path, over all its attempts. ``att``: the attempt under way (its worker
    chosen, not yet released); ``up``: the worker connection its answer is awaited on; ``expiry``: when the client's
    deadline gives that wait up (time.monotonic)."""
    __slots__ = ("router", "conn", "call", "admitted", "att", "up", "origin", "expiry", "timer", "connecting",
                 "task", "over", "refused")

    def __init__(self, router, conn, call, admitted: bool):
        self.router, self.conn, self.call, self.admitted = router, conn, call, admitted
        self.att = self.up = self.origin = self.timer = self.connecting = self.task = None
        self.expiry = _NEVER
        self.over = self.refused = False

    def start(self) -> None:
        self.conn.flight = self
        self.router._flights[self] = None
        self.call.outcome = "no_worker"
        try:  # (inline rather than _guarded on the three callbacks every request goes through)
            self._go(None)
        except Exception:
            self._crashed()

    # ------------------------------------------------------------------ the attempts

    def _go(self, failed: Failed | None) -> None:
        """The next attempt after ``failed`` (None: the first), or the last failure answered when none is left."""
        r, call = self.router, self.call
        try:
            plan = r._next(call, failed)
        except ApiError as err:  # no worker to send the first attempt to
            self._answer(self.conn.send_error, err)
            return
        if plan is None:
            return self._give_up(failed)
        call.outcome = CLIENT_DISCONNECT  # until an answer is ready
        pool, delay = plan
        if failed is None:
            return self._dispatch(pool)
        if time.monotonic() + delay >= r._deadline(call)[0]:
            return self._give_up(failed)  # the client's deadline comes first: answer with the last failure
        self.timer = self.conn.loop.call_later(delay, self._retry, pool, failed)  # a backoff: rare, a timer

    @_guarded
    def _retry(self, pool: list, failed: Failed) -> None:
        self.timer = None
        core = self.router.core
        now = core.clock()
        pool = [w for w in pool if core.is_current(w) and w.routable(max(now, w.not_before))]
        if not pool:
            return self._give_up(failed)
        self._dispatch(pool)

    def _dispatch(self, pool: list) -> None:
        r, call = self.router, self.call
        # every worker routable (the usual case): the policy's own candidates are the same list (Router._forward)
        att = self.att = r.core.dispatch(call.request, None if len(pool) == len(r.workers) else pool,
                                         retry=bool(call.tried))
        call.tried.append(att.worker)
        deadline = r._deadline(call)[0]
        left = r.core.hold(att, deadline - time.monotonic())
        if left > 0:  # held for the worker's KV events (rare): until they let it go (unheld) or the hold runs out
            att.ref = self
            self.timer = self.conn.loop.call_later(left, self._hold_over)
            return
        self._send(deadline)

    @_guarded
    def unheld(self) -> None:
        """A batch of the worker's KV events let the held attempt go (service._wake)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._send(self.router._deadline(self.call)[0])

    @_guarded
    def _hold_over(self) -> None:
        self.timer = None
        self.router.core.hold_over(self.att)
        self._send(self.router._deadline(self.call)[0])

    def _send(self, deadline: float) -> None:
        """The attempt's request on a worker connection; its answer awaited until ``deadline``."""
        r = self.router
        origin = self.origin = r._origin(self.att.worker)
        self.expiry = deadline
        data = origin.request(self.call, dp_rank_of(self.att.decision))   # router.dp_aware: the DP group chosen
        up = r.pool.take(origin.key)
        if up is None:  # no idle connection to this worker: open one (a task: the pool is empty only at first)
            self.connecting = task = self.conn.loop.create_task(r.pool.connect(origin.key))
            task.add_done_callback(functools.partial(self._connected, data))
            return
        self.up = up
        up.send(data, self)

    @_guarded
    def _connected(self, data: bytes, task: asyncio.Task) -> None:
        if self.connecting is not task:  # given up meanwhile (the client left, the deadline passed)
            if not task.cancelled() and task.exception() is None:
                task.result().close()
            return
        self.connecting = None
        exc = task.exception()
        if exc is not None:
            if not isinstance(exc, OSError):
                raise exc
            self._failed(self.router.broke(self.att, exc))
            return
        self.up = up = task.result()
        up.send(data, self)

    # ------------------------------------------------------------------ the worker's connection tells

    def on_head(self, up) -> None:
        try:
            self.refused, relay = judged(up)
            if relay:  # an answer that streams, to a request that asked for none: read on in a task
                self.up, self.expiry, up.flight, up._whole = None, _NEVER, None, False
                self.task = self.conn.loop.create_task(self._relay(up))
        except Exception:
            self._crashed()

    def on_complete(self, up) -> None:
        try:
            self.up, self.expiry = None, _NEVER
            r, att = self.router, self.att
            body = up.body()
            if self.refused:
                failed = r._refused(att, up, body)
                up.release()
                return self._failed(failed)
            try:
                status = r._answered(self.conn, att, up, self.origin, body)
            except ConnectionResetError:  # the client closed while its answer came
                status = None
            up.release()
            self._end_attempt()
            self.call.outcome = att.outcome or (CLIENT_DISCONNECT if status is None else
                                                "ok" if status < 400 else "client_error")
            self._finish()
        except Exception:
            self._crashed()

    @_guarded
    def on_error(self, up, exc: OSError) -> None:
        """The worker's connection failed before the answer was whole (closed, or a malformed response)."""
        self.up, self.expiry = None, _NEVER
        up.close()
        self._failed(self.router.broke(self.att, exc))

    @_guarded
    def expired(self) -> None:
        """The client's deadline passed while the attempt waited on its worker (the router's sweep)."""
        self.expiry = _NEVER
        self._stop_waiting()
        exc = WorkerTimeout(f"the client request's deadline passed ({self.router._deadline(self.call)[1]})",
                            silence=False)
        self._failed(self.router.broke(self.att, exc))

    async def _relay(self, up) -> None:
        r, call, att = self.router, self.call, self.att
        try:
            result = await r.relay_attempt(self.conn, call, att, up, self.origin)  # releases up and the attempt
        except asyncio.CancelledError:  # the client left (client_gone)
            self.att = self.task = None
            call.outcome = CLIENT_DISCONNECT
            self._finish()
            raise
        except Exception:
            self.att = self.task = None
            self._crashed()
            return
        self.att = self.task = None
        if isinstance(result, Failed):  # nothing went to the client yet: the next attempt
            self._go(result)
        else:
            call.outcome = att.outcome or ("ok" if result < 400 else "client_error")
            self._finish()

    # ------------------------------------------------------------------ endings

    def _failed(self, failed: Failed) -> None:
        """The attempt under way failed: released, then the next one (or the answer, with ``failed``)."""
        self._end_attempt()
        self._go(failed)

    def _give_up(self, failed: Failed) -> None:
        self.call.outcome = "timeout" if failed.timeout else "upstream_error"
        self._answer(failed.send, self.conn, len(self.call.tried))

    def _answer(self, send, *args) -> None:
        """``send(*args)`` answers the client; then the request is over."""
        try:
            send(*args)
        except ConnectionResetError:
            self.call.outcome = CLIENT_DISCONNECT
        self._finish()

    @_guarded
    def client_gone(self) -> None:
        """The client left before its answer (server.Connection): whatever is under way stops (a worker whose
        connection closes aborts the generation)."""
        if self.task is not None:
            self.task.cancel()  # the relay ends the request
            return
        self._abandon()
        self.call.outcome = CLIENT_DISCONNECT
        self._finish()

    def _abandon(self) -> None:
        """Stop whatever is under way: the worker's answer awaited, a backoff or hold timer, the attempt's decision."""
        self._stop_waiting()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._end_attempt()

    def _stop_waiting(self) -> None:
        if self.up is not None:
            self.up.close()
            self.up = None
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None

    def _end_attempt(self) -> None:
        att, self.att = self.att, None
        if att is not None:
            self.router.core.release(att)  # exactly once per attempt; a held one is unheld there

    def _finish(self) -> None:
        """Exactly once per request: the admission slot back, the outcome counted."""
        if self.over:
            return
        self.over = True
        r = self.router
        r._flights.pop(self, None)
        if self.conn.flight is self:
            self.conn.flight = None
        if self.admitted:
            r.admission.release()
        r.stats.outcomes[self.call.route, self.call.outcome] += 1

    def _crashed(self) -> None:
        """A bug in a callback: logged, everything under way released, a 500 when nothing was answered yet."""
        log.exception("unhandled error on POST %s", self.call.route)
        if self.over:
            return
        self._abandon()
        conn = self.conn
        if conn.request is not None and not conn.started and not conn.closed:
            self._answer(conn.send_error, ApiError(500, f"internal error while handling POST {self.call.route}"))
        else:
            if conn.transport is not None:
                conn.transport.close()
            self._finish()
