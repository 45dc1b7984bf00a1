"""The HTTP router's prefill/decode disaggregation: each worker's role, and a request sent to a pair of workers.

Roles: once a worker passes a health check the router asks its ``GET /server_info`` (SGLang's): ``disaggregation_mode``
(``null``/absent: mixed, ``prefill``, ``decode``), a prefill's ``disaggregation_bootstrap_port``, and whether a decode
worker serves a request without bootstrap fields itself (servelab's ``disaggregation_local_prefill``). A worker that
does not answer it is asked again at the next check (and meanwhile routed as a mixed one). With any prefill or decode
worker the router routes pairs: mixed workers and workers whose role is not known yet get nothing.

A request, as sglang-router 0.3.2's P/D mode sends it (sgl-router src/routers/http/pd_router.rs,
``execute_dual_dispatch``): the pair is chosen afresh for each attempt (framework/routing/pairs.py, the policy's
``select_pair``), the same body goes to both with ``bootstrap_host`` (the prefill worker's host),
``bootstrap_port`` (its bootstrap port) and a random ``bootstrap_room`` added, and the client gets the decode
worker's answer (streams relayed as they come). The prefill answer is read in the background and not waited for.
A retriable failure of the decode answer (connection error, 408, 429, 5xx, a silent stream's confirmed abort) is
retried on a new pair after the router's backoff, at most ``router.max_retries`` times; servelab's difference: the
new pair prefers workers not tried yet. Unlike sglang-router, which counts the decode answer against both workers'
breakers, each half counts its own answer. A batch (a list of prompts) is refused with a 400.

``router.dp_aware`` (as sglang's PD router with ``--dp-aware`` since sgl-project/sglang#26245; 0.3.2's sends each
half to the ``url@rank`` string as its URL and fails): each role's policy picks a DP group of its worker too
(framework/routing/pairs.py ``role_policies``; dp_size from the same ``/server_info``), and the pair's bodies name
them: the prefill half's ``data_parallel_rank`` is its group, the decode half's is its own and
``disagg_prefill_dp_rank`` the prefill's (where the KV comes from). servelab's addition: the room is drawn so that
``bootstrap_room % prefill dp_size`` is the prefill group, so a prefill worker that still places paired requests by
SGLang's ``follow_bootstrap_room`` (and a decode worker that guesses the prefill group the same way) agrees with the
router. A decode worker that prefills locally gets its group in the ``X-Data-Parallel-Rank`` header, as in the
single-role path.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from urllib.parse import urlsplit

import aiohttp

from framework.routing.core import FAIL, OK
from framework.routing.dp_aware import DPAware, dp_rank_of
from framework.routing.pairs import DECODE, PREFILL, dispatch_pair, role_policies
from framework.routing.workers import WorkerState
from framework.serving.http.errors import ApiError
from framework.serving.router.events import parse_usage
from framework.serving.router.health import describe_error
from framework.serving.router.upstream import UpstreamConnectError
from framework.serving.router.wire import Failed, forwarded_head

ROLES = ("mixed", PREFILL, DECODE)
_BATCH_FIELDS = ("text", "prompt", "input_ids")


def role_of(info: dict) -> tuple[str, int | None, bool]:
    """(role, bootstrap port, local prefill) from a worker's /server_info answer."""
    mode = info.get("disaggregation_mode")
    role = "mixed" if mode in (None, "null", "") else str(mode)
    if role not in ROLES:
        raise ValueError(f"disaggregation_mode {mode!r} is not one of null, prefill, decode")
    port = info.get("disaggregation_bootstrap_port")
    if role == PREFILL and not isinstance(port, int):
        raise ValueError("a prefill worker's /server_info gives no disaggregation_bootstrap_port")
    return role, port if role == PREFILL else None, bool(info.get("disaggregation_local_prefill"))


def paired_body(body: dict, prefill: WorkerState, room: int, dp_rank: int | None = None,
                prefill_dp_rank: int | None = None) -> bytes:
    """The body a half gets: the client's with SGLang's bootstrap fields; router.dp_aware: with the DP group chosen
    on that half (``data_parallel_rank``) and, for the decode half, the prefill's (``disagg_prefill_dp_rank``)."""
    fields = {"bootstrap_host": urlsplit(prefill.url).hostname, "bootstrap_port": prefill.bootstrap_port,
              "bootstrap_room": room}
    if dp_rank is not None:
        fields["data_parallel_rank"] = dp_rank
    if prefill_dp_rank is not None:
        fields["disagg_prefill_dp_rank"] = prefill_dp_rank
    return json.dumps({**body, **fields}).encode()


def aligned_room(room: int, rank: int | None, dp_size: int) -> int:
    """``room`` with its remainder mod ``dp_size`` replaced by ``rank`` (SGLang's follow_bootstrap_room places a
    paired request on group ``bootstrap_room % dp_size``); unchanged without a rank. A 63-bit room stays < 2**64."""
    if rank is None or dp_size <= 1:
        return room
    return room - room % dp_size + rank


def has_pd_workers(core) -> bool:
    """Whether any worker serves prefill or decode, asked per request: its role's policy holds exactly the workers
    of that role (core.set_role moves a worker there, remove_worker takes it out), so two dict looks, not a scan of
    every worker."""
    roles = core.role_policies
    prefill, decode = roles.get(PREFILL), roles.get(DECODE)
    return bool(prefill is not None and prefill.loads or decode is not None and decode.loads)


class PairRouting:
    """The router's P/D side; ``router`` is the Router (service.py), whose attempt, hold and deadlines it reuses."""

    def __init__(self, router):
        self.r = router
        self._info_timeout = aiohttp.ClientTimeout(total=router.cfg.health_check_timeout_secs)
        self._prefills: set[asyncio.Task] = set()  # prefill answers being read (not waited for)
        c = router.cfg   # a policy instance per role, as sglang-router keeps (workers move in as their roles are known)
        router.core.set_role_policies(role_policies(router.core.policy, getattr(c, "prefill_policy", None),
                                                    getattr(c, "decode_policy", None), bool(c.dp_aware)))

    @property
    def active(self) -> bool:
        return has_pd_workers(self.r.core)

    async def discover(self) -> None:
        """Ask every healthy worker whose role is not known yet."""
        await asyncio.gather(*(self._ask(w) for w in list(self.r.workers.values()) if w.healthy and w.role is None))

    async def _ask(self, w: WorkerState) -> None:
        try:
            async with self.r.session.get(w.url + "/server_info", timeout=self._info_timeout) as resp:
                if resp.status == 404:
                    self.r.core.set_role(w.url, "mixed")  # not an SGLang-style worker: no roles
                    return
                info = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, ValueError):
            return  # asked again at the next health check
        if isinstance(info, dict):
            try:
                role, w.bootstrap_port, w.local_prefill = role_of(info)
                if self.r.core.is_current(w):
                    self.r.core.set_role(w.url, role)   # into its role's policy
                    dp_size = info.get("dp_size")    # router.dp_aware: a candidate per DP group, when it says
                    if isinstance(policy := self.r.core.policy_of(w.url), DPAware) and isinstance(dp_size, int):
                        policy.set_dp_size(w.url, max(1, dp_size))   # (else router.kv_events_dp_size's, if set)
            except ValueError as e:
                w.last_health_error = f"{w.url}/server_info: {e}"

    def _dp_size(self, w: WorkerState) -> int:
        """Worker ``w``'s DP groups as its role's policy counts them (1 when the router does not address groups)."""
        policy = self.r.core.policy_of(w.url)
        return policy.sizes.get(w.url, 1) if isinstance(policy, DPAware) else 1

    async def close(self) -> None:
        for t in list(self._prefills):
            t.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)

    # ------------------------------------------------------------------ a request

    def _pools(self, call, failed: Failed | None) -> tuple[list, list, float] | None:
        r = self.r
        routable = r.core.routable(r.core.clock())
        prefill = [w for w in routable if w.role == PREFILL]
        decode = [w for w in routable if w.role == DECODE]
        if failed is None:
            if not prefill or not decode:
                raise ApiError(503, f"no routable {'prefill' if not prefill else 'decode'} worker for a P/D pair "
                                    f"({len(r.workers)} registered: "
                                    f"{[{**w.describe(), 'role': w.role} for w in r.workers.values()]})")
            return prefill, decode, 0.0
        if not failed.retriable or len(call.tried) > r.cfg.max_retries or not prefill or not decode:
            return None
        fresh = [w for w in decode if w not in call.tried]
        return prefill, fresh or decode, max(r._backoff_s(len(call.tried)), failed.retry_after or 0.0)

    async def forward(self, req, conn, call) -> None:
        """The P/D counterpart of Router._forward."""
        r, c = self.r, self.r.cfg
        body = json.loads(call.raw)  # (parse_body checked it is a JSON object)
        if any(isinstance(body.get(f), list) and body[f] and isinstance(body[f][0], (str, list))
               for f in _BATCH_FIELDS):
            raise ApiError(400, "a P/D router takes one prompt per request (text, prompt or input_ids), not a batch")
        call.outcome = "no_worker"
        failed, tried_prefill = None, []
        while (plan := self._pools(call, failed)) is not None:
            call.outcome = "client_disconnect"
            prefill_pool, decode_pool, delay = plan
            if failed is not None:
                if time.monotonic() + delay >= r._deadline(call)[0]:
                    break
                await asyncio.sleep(delay)
                now = r.core.clock()
                prefill_pool = [w for w in prefill_pool if r.core.is_current(w) and w.routable(now)]
                decode_pool = [w for w in decode_pool if r.core.is_current(w) and w.routable(now)]
                if not prefill_pool or not decode_pool:
                    break
            prefill_pool = [w for w in prefill_pool if w not in tried_prefill] or prefill_pool
            pair = dispatch_pair(r.core, call.request, prefill_pool, decode_pool, c.pd_decider,
                                 c.pd_local_prefill_max_tokens, c.pd_max_prefill_queue, c.pd_bytes_per_token,
                                 retry=bool(call.tried))
            call.tried.append(pair.decode.worker)
            first = pair.prefill or pair.decode  # the half that prefills: a policy's hold is about its cache
            left = r.core.hold(first, r._deadline(call)[0] - time.monotonic())
            if left > 0:
                try:
                    await r._hold(first, left)
                except BaseException:
                    for att in (pair.prefill, pair.decode):
                        if att is not None:
                            r.core.release(att)
                    raise
            if pair.prefill is not None:
                tried_prefill.append(pair.prefill.worker)
                p_rank, d_rank = dp_rank_of(pair.prefill.decision), dp_rank_of(pair.decode.decision)
                room = aligned_room(secrets.randbits(63), p_rank, self._dp_size(pair.prefill.worker))
                p_raw = paired_body(body, pair.prefill.worker, room, p_rank)
                call.raw = p_raw if p_rank is None and d_rank is None else \
                    paired_body(body, pair.prefill.worker, room, d_rank, p_rank)   # router.dp_aware
                call.head = forwarded_head(req, len(call.raw))
                task = asyncio.create_task(self._prefill(call.route, forwarded_head(req, len(p_raw)), p_raw,
                                                         pair.prefill, r._deadline(call)[0]))
                self._prefills.add(task)
                task.add_done_callback(self._prefills.discard)
            else:
                call.raw, call.head = req.body, forwarded_head(req, len(req.body))
            result = await r._attempt(conn, call, pair.decode)
            if not isinstance(result, Failed):
                call.outcome = pair.decode.outcome or ("ok" if result < 400 else "client_error")
                return
            failed = result
        call.outcome = "timeout" if failed.timeout else "upstream_error"
        failed.send(conn, len(call.tried))

    async def _prefill(self, route: str, head: bytes, raw: bytes, att, done_by: float) -> None:
        """The prefill half: sent, its answer read to the end (it comes once the KV is sent) and dropped."""
        r, w = self.r, att.worker
        origin = r._origin(w)
        up = None
        try:
            up = await asyncio.wait_for(r.pool.request(origin.key, b"POST %s HTTP/1.1\r\nHost: %s\r\n%s%s" % (
                route.encode(), origin.host, head, raw)), max(0.0, done_by - time.monotonic()))
            body = await asyncio.wait_for(up.read(), max(0.0, done_by - time.monotonic()))
            status = up.status
            att.served = status < 400
            att.verdict = OK if status < 500 else FAIL if status not in (503, 504) else None
            if att.served and r.core.wants_usage:
                att.usage = parse_usage(body)
        except TimeoutError:
            att.verdict = None
        except OSError as exc:
            att.verdict = FAIL
            if isinstance(exc, UpstreamConnectError):
                w.healthy, w.unreachable = False, True
            w.last_health_error = describe_error(exc)
        finally:
            if up is not None:
                up.release()
            r.core.release(att)
