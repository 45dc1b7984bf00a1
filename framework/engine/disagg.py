"""A rank's side of prefill/decode disaggregation, without I/O: the request queues of SGLang's disaggregation
(disaggregation/prefill.py, decode.py) over the scheduler's KV pool, req_to_token table and radix cache. The KV
itself moves through framework/instance/kv_connector.py, which calls the methods here in the same step on every rank
of the instance (the rank loop turns its events into commands), so the ranks' pools stay in lockstep.

Prefill role: in SGLang's order (`engine.disaggregation_order=sglang`, the real path's connector decides) a paired
request first waits, holding no KV, for its room's destination (`bootstrapping`, SGLang's PrefillBootstrapQueue);
then (at once in DistServe's order) it runs as on a mixed instance with max_new_tokens 1 (SGLang's prefill side
returns after the prefill); when its prefill finishes, its KV is held (row, slots, cache lock: `sending`, SGLang's
inflight queue) until the connector has sent it, then released into the radix cache as any finished request.

Decode role: a request waits for KV slots (`waiting_slots`, SGLang's DecodePreallocQueue): a req_to_token row and a
slot per prompt token it lacks, admitted in arrival order while the pool keeps each running or receiving request's
next tokens free (up to `engine.disaggregation_decode_reserve_tokens` each: SGLang's RESERVED_DECODE_TOKENS; 0 is
DistServe's admission, the prompt's slots alone); then it receives (`receiving`, SGLang's DecodeTransferQueue);
when the KV and the prefill's sampled first token have landed it joins the running batch with that token as its
first output and decodes. With `disaggregation_decode_prefix_reuse` the slots it lacks exclude the longest prefix its
own radix cache holds (servelab's switch; SGLang pre-allocates the whole prompt).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from framework.engine.config import Role
from framework.engine.request import Req
from framework.engine.schedule_policy import prefix_key

RESERVED_DECODE_TOKENS = 512      # SGLang's SGLANG_NUM_RESERVED_DECODE_TOKENS: a decode request's future tokens kept


@dataclass(frozen=True)
class Pairing:
    """SGLang's bootstrap fields: the prefill instance's bootstrap address and the room pairing a request's halves."""
    room: int
    host: str
    port: int


@dataclass(frozen=True)
class Destination:
    """Where a decode rank wants a request's KV: its slots for the prompt's tokens from `first` on."""
    rid: str
    first: int                 # prompt tokens the decode side already holds (its radix cache), not sent
    slots: list[int]           # one per prompt token from `first` on


class Disaggregation:
    def __init__(self, scheduler, role: Role, prefix_reuse: bool):
        self.s, self.role, self.prefix_reuse = scheduler, Role(role), prefix_reuse
        self.reserve_tokens = int(getattr(scheduler.cfg, "disaggregation_decode_reserve_tokens", RESERVED_DECODE_TOKENS))
        self.waiting_slots: list[Req] = []
        self.receiving: dict[str, Req] = {}
        self.abandoned: set[str] = set()         # aborted while receiving: slots kept until the prefill answers
        self.sending: dict[str, Req] = {}
        self.bootstrapping: dict[str, Req] = {}  # prefill, SGLang's order: waiting for the room's destination
        self.prefilling: dict[str, Req] = {}     # prefill: in the scheduler's queues, its KV not held yet
        self._allocated: list[Destination] = []

    # -- both roles ---------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a request that carries a pairing (a prefill one: ValueError when it can never run here)."""
        if self.role is Role.prefill:
            req.params = dataclasses.replace(req.params, max_new_tokens=1)
            self.s.add(req)
            self.prefilling[req.rid] = req
            return
        self.waiting_slots.append(req)              # (the scheduler checked it could ever fit)

    def pending(self) -> int:
        """Requests in a disaggregation queue (the rank loop keeps polling while any is)."""
        return len(self.waiting_slots) + len(self.receiving) + len(self.sending) + len(self.bootstrapping)

    def stats(self) -> dict:
        return {"kv_waiting_slots": len(self.waiting_slots), "kv_receiving": len(self.receiving),
                "kv_sending": len(self.sending), "kv_bootstrapping": len(self.bootstrapping)}

    # -- prefill --------------------------------------------------------------------------------------------------
    def park(self, req: Req) -> None:
        """SGLang's order: queue a paired prefill request to wait for its room's destination (`admit`), holding no
        KV meanwhile, so it blocks no other request (the caller set max_new_tokens 1 and checked it can ever run
        here)."""
        self.bootstrapping[req.rid] = req

    def admit(self, rid: str) -> None:
        """The room's destination came: the parked request joins the scheduler's waiting queue."""
        req = self.bootstrapping.pop(rid, None)
        if req is not None:
            self.s.add(req)
            self.prefilling[rid] = req

    def hold(self, req: Req) -> bool:
        """A request just finished (scheduler.process): keep a paired request's KV for the connector (True)."""
        if self.role is not Role.prefill or req.pairing is None:
            return False
        self.prefilling.pop(req.rid, None)
        if req.finish_reason == "abort":
            return False
        self.sending[req.rid] = req
        return True

    def kv_of(self, rid: str, first: int) -> torch.Tensor | None:
        """A held request's slots for its prompt tokens from `first` on (None when it is not held)."""
        req = self.sending.get(rid)
        if req is None:
            return None
        return self.s.req_to_token.slots(req.req_pool_idx, len(req.prompt_ids), first).clone()

    def sent(self, rid: str) -> Req | None:
        """The connector is done with a held request's KV (sent, failed or cancelled): release it as finished."""
        req = self.sending.pop(rid, None)
        if req is not None:
            self.s.cache.cache_finished_req(req)
            self.s.batch_is_full = False      # its KV is free: a waiting request refused for room may fit now
        return req

    # -- decode ---------------------------------------------------------------------------------------------------
    def preallocate(self) -> None:
        """Give waiting requests their row and slots, in arrival order, while the pool keeps every decoding
        request's reserve free."""
        s = self.s
        while self.waiting_slots:
            req = self.waiting_slots[0]
            if s.num_running() + len(self.receiving) >= s.max_running or s.req_to_token.available() == 0:
                return
            prefix, node = (s.cache.match_prefix(prefix_key(req)) if self.prefix_reuse
                            else (torch.empty(0, dtype=torch.int32), s.cache.root))
            need = len(req.prompt_ids) - len(prefix)
            s.cache.inc_lock_ref(node)
            reserve = sum(min(self.reserve_tokens, r.params.max_new_tokens - len(r.output_ids))
                          for r in [*s.running, *self.receiving.values(), req] if not r.finished)
            if s.pool.available() + s.cache.evictable_size() < need + reserve:
                s.cache.dec_lock_ref(node)
                return
            out = s.pool.alloc(need)
            if out is None:
                s.cache.evict(need - s.pool.available())
                out = s.pool.alloc(need)
            self.waiting_slots.pop(0)
            req.req_pool_idx = s.req_to_token.alloc()
            s.req_to_token.write(req.req_pool_idx, 0, prefix)
            s.req_to_token.write(req.req_pool_idx, len(prefix), out)
            req.prefix_indices, req.last_node = prefix, node
            self.receiving[req.rid] = req
            self._allocated.append(Destination(req.rid, len(prefix), [int(x) for x in out] if isinstance(
                out, torch.Tensor) else out))              # the simulator's counting pool: counted slots, unnamed

    def take_allocated(self) -> list[Destination]:
        """The destinations allocated since the last call (the connector asks the prefill side for their KV)."""
        out, self._allocated = self._allocated, []
        return out

    def arrived(self, rid: str, first_token: int, cached_tokens: int, now: float) -> Req | None:
        """A request's KV and first token landed: it joins the running batch (or finishes at once). None when it is
        no longer receiving; an abandoned request's slots are freed instead."""
        req = self.receiving.pop(rid, None)
        if req is None:
            return None
        if rid in self.abandoned:
            self._free(req)
            return None
        s = self.s
        req.kv_len = len(req.prompt_ids)
        req.cached_tokens = cached_tokens
        req.output_ids.append(first_token)
        req.first_token_time, req.engine_ttft_s = now, now - req.arrival_time
        req.check_finished(s.eos_id, s.decode_tail)
        if req.finished:
            req.finish_time = now
            s.cache.cache_finished_req(req)
        else:
            if self.prefix_reuse:
                s.cache.cache_unfinished_req(req)
            s.running.append(req)
        return req

    def failed(self, rid: str) -> Req | None:
        """A transfer failed (or an abandoned one ended): free what the request holds; the request is returned when
        its client still waits (not abandoned)."""
        if self.role is Role.prefill:
            parked = self.bootstrapping.pop(rid, None)
            return parked if parked is not None else self.sent(rid)
        req = self.receiving.pop(rid, None)
        if req is None:
            return None
        self._free(req)
        return None if req.finish_reason == "abort" else req

    def abort(self, rid: str) -> bool:
        """The client left: drop a waiting request now; a receiving one keeps its slots (the prefill side may still
        write them) until the connector says its room ended. True when the request was here."""
        for req in self.waiting_slots:
            if req.rid == rid:
                self.waiting_slots.remove(req)
                req.finish_reason = "abort"
                return True
        req = self.receiving.get(rid)
        if req is not None:
            req.finish_reason = "abort"
            self.abandoned.add(rid)
            return True
        req = self.bootstrapping.pop(rid, None)
        if req is not None:                     # a parked prefill holds nothing
            req.finish_reason = "abort"
            return True
        self.prefilling.pop(rid, None)          # (the scheduler drops it; the connector already freed its room)
        return rid in self.sending              # a held prefill: the connector releases it

    def _free(self, req: Req) -> None:
        s = self.s
        self.abandoned.discard(req.rid)
        s.pool.free(s.req_to_token.slots(req.req_pool_idx, len(req.prompt_ids), len(req.prefix_indices)).clone())
        s.req_to_token.free(req.req_pool_idx)
        s.cache.dec_lock_ref(req.last_node)
        req.release_kv()
