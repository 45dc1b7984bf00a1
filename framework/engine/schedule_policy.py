"""Which waiting requests a prefill batch takes, and in what order: SGLang v0.4.1's managers/schedule_policy.py
(SchedulePolicy.calc_priority, PrefillAdder), decision for decision.

KV budget of one prefill batch (PrefillAdder): free + evictable slots, less each running request's remaining
max_new_tokens (clipped to 4096) times new_token_ratio. A new request costs its extend tokens plus its whole clipped
max_new_tokens (a non-last chunk: only its extend tokens); the being-chunked request is always taken, at most one
chunk. Requests that ignore EOS with the radix cache off take `add_one_req_ignore_eos`, which simulates the
remaining decode steps instead.
"""
from __future__ import annotations

import enum

import torch

from framework.engine.radix_cache import RadixCache

CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096          # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32    # a waiting request matching at most this much of the tree...
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32   # ...waits behind an earlier one sharing this many tokens
LPM_MAX_WAITING = 128                           # beyond this many waiting requests lpm falls back to fcfs


class AddReqResult(enum.Enum):
    CONTINUE = "continue"    # room for more
    NO_TOKEN = "no_token"    # the KV budget is spent (the batch is full)
    OTHER = "other"          # the input or chunk budget is spent


def prefix_key(req) -> list[int]:
    """What a request looks up in the tree: all but its last token, which must run to give logits."""
    return req.fill_ids[:-1]


def calc_priority(policy: str, cache: RadixCache, waiting: list) -> bool:
    """Order the waiting queue in place. lpm: match every waiting request's prefix, longest first; a request with a
    short match that shares a 32-token prefix with an earlier waiting one goes last (in-batch prefix caching: one of
    them fills the cache, the others then hit it). Returns whether the prefixes were matched here."""
    if policy != "lpm" or not cache.enabled or len(waiting) > LPM_MAX_WAITING:
        return False
    in_batch = RadixCache(lambda slots: None)
    deprioritized = set()
    for req in waiting:
        key = prefix_key(req)
        req.prefix_indices, req.last_node = cache.match_prefix(key)
        if len(req.prefix_indices) <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
            if in_batch.match_prefix(key)[0].shape[0] >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                deprioritized.add(id(req))
            else:
                in_batch.insert(key, torch.zeros(len(key), dtype=torch.int32))
    waiting.sort(key=lambda r: float("inf") if id(r) in deprioritized else -len(r.prefix_indices))
    return True


def _clipped_max_new(req) -> int:
    return min(req.params.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION)


class PrefillAdder:
    def __init__(self, cache: RadixCache, running: list, new_token_ratio: float, rem_total_tokens: int,
                 rem_input_tokens: int, rem_chunk_tokens: int):
        self.cache, self.running, self.new_token_ratio = cache, running, new_token_ratio
        self.rem_total_tokens = rem_total_tokens - sum(
            min(r.params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATION) * new_token_ratio
            for r in running)
        self.cur_rem_tokens = rem_total_tokens
        self.rem_input_tokens, self.rem_chunk_tokens = rem_input_tokens, rem_chunk_tokens
        self.can_run_list: list = []
        self.new_being_chunked_req = None
        self._req_states: list[tuple[float, int]] | None = None

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or self.rem_chunk_tokens <= 0:
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _prefill_one_req(self, extend_input_len: int, max_new_tokens: int) -> None:
        self.rem_total_tokens -= extend_input_len + max_new_tokens
        self.cur_rem_tokens -= extend_input_len
        self.rem_input_tokens -= extend_input_len
        self.rem_chunk_tokens -= extend_input_len

    def add_being_chunked_req(self, req):
        """The request mid-prefill goes first, one chunk. Returns it while its prefill is still unfinished."""
        truncated = req.extend_input_len > self.rem_chunk_tokens
        req.extend_input_len = min(req.extend_input_len, self.rem_chunk_tokens)
        self.can_run_list.append(req)
        self._prefill_one_req(req.extend_input_len, 0 if truncated else _clipped_max_new(req))
        return req if truncated else None

    def _lock(self, node) -> None:
        self.rem_total_tokens += self.cache.inc_lock_ref(node)

    def _unlock(self, node) -> None:
        self.rem_total_tokens += self.cache.dec_lock_ref(node)

    def add_one_req(self, req) -> AddReqResult:
        if req.params.ignore_eos and not self.cache.enabled:
            return self._add_one_req_ignore_eos(req)
        reserve = _clipped_max_new(req)
        if req.output_ids and not self.running and not self.can_run_list:
            # servelab: a retracted request re-admitted into an idle engine reserves only the tokens it has left.
            # SGLang reserves all of max_new_tokens again; when that no longer fits the empty pool it never runs
            # again and batch_is_full, with nothing running to reset it, stops the engine for good.
            reserve = min(req.params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATION)
        total_tokens = req.extend_input_len + reserve
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if req.extend_input_len > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        self._lock(req.last_node)          # its prefix stops being evictable while we decide
        try:
            if total_tokens > self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if self._take_whole_or_chunk(req, reserve, lock=True) is AddReqResult.OTHER:
                return AddReqResult.OTHER
        finally:
            self._unlock(req.last_node)
        return self.budget_state()

    def _take_whole_or_chunk(self, req, reserve: int, lock: bool) -> AddReqResult | None:
        """Admit the request whole (reserving ``reserve`` output tokens) or, when its input is longer than the chunk
        room left, its next chunk (no output reserved yet); OTHER when no chunk room is left. ``lock``: the request
        holds its prefix's lock until it finishes (SGLang's ignore_eos path takes none)."""
        if req.extend_input_len > self.rem_chunk_tokens:
            if self.rem_chunk_tokens == 0:
                return AddReqResult.OTHER
            req.extend_input_len = self.rem_chunk_tokens
            self.new_being_chunked_req = req
            reserve = 0
        self.can_run_list.append(req)
        if lock:
            self.cache.inc_lock_ref(req.last_node)
        self._prefill_one_req(req.extend_input_len, reserve)
        return None

    def _add_one_req_ignore_eos(self, req) -> AddReqResult:
        """Simulate the decode steps ahead: requests sorted by tokens left; when the one with the fewest finishes it
        frees what it holds. NO_TOKEN if at any point the batch would need more slots than there are."""
        if self._req_states is None:
            self._req_states = []
            for r in [req, *self.running, *self.can_run_list]:
                self._add_req_state(r, insert_sorted=False)
            self._req_states.sort(key=lambda s: s[0])
        else:
            self._add_req_state(req, insert_sorted=True)
        cur_rem_tokens = self.cur_rem_tokens - len(req.prompt_ids)
        tokens_freed = 0
        for i, (tokens_left, tokens_occupied) in enumerate(self._req_states):
            decode_steps = self._req_states[i + 1][0] if i + 1 < len(self._req_states) else tokens_left
            if cur_rem_tokens + tokens_freed - decode_steps * (len(self._req_states) - i) <= 0:
                return AddReqResult.NO_TOKEN
            tokens_freed += tokens_occupied
        if self._take_whole_or_chunk(req, _clipped_max_new(req), lock=False) is AddReqResult.OTHER:
            return AddReqResult.OTHER
        return self.budget_state()

    def _add_req_state(self, r, insert_sorted: bool) -> None:
        ratio = 1.0 if r.params.ignore_eos else self.new_token_ratio
        tokens_left = r.params.max_new_tokens * ratio - len(r.output_ids)
        if tokens_left <= 0:
            return
        state = (tokens_left, len(r.prompt_ids) + len(r.output_ids))
        if not insert_sorted:
            self._req_states.append(state)
            return
        # SGLang's insertion: before the first state with at least as many tokens left; when there is none, before
        # the last state (its loop variable stops at the last index), which we keep
        i = 0
        for i in range(len(self._req_states)):
            if tokens_left <= self._req_states[i][0]:
                break
        self._req_states.insert(i, state)
