"""One rank's scheduler: continuous batching over a KV pool and a radix cache.

Each step it forms one batch: EXTEND (admit waiting requests, chunked) or DECODE (one token per running request).
After an EXTEND step with decodes waiting, a DECODE step always follows, so a long prompt prefilled in chunks
never stalls running decodes for more than one chunk. Admission reserves KV for running requests' future tokens
by `new_token_ratio` (SGLang's policy): the pool is never over-committed; when decode runs out of slots anyway,
the newest requests are retracted (their tokens go to the radix cache) and resumed later; none is dropped.

The forward pass is not called here: `next_batch()` returns what to run and `process(batch, tokens)` takes the
sampled tokens, so the simulator can drive the same scheduler with a cost model.
"""
from __future__ import annotations

import torch

from framework.engine.batch import ForwardBatch, ForwardMode
from framework.engine.config import EngineConfig
from framework.engine.kv_pool import KVPool
from framework.engine.radix_cache import RadixCache
from framework.engine.request import Req


def check_admissible(req: Req, capacity: int | None) -> None:
    """Raise ValueError, in one sentence, for a request that could never run on a rank of `capacity` KV slots."""
    req.params.validate()
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    need = len(req.prompt_ids) + req.params.max_new_tokens
    if capacity is not None and need > capacity:
        raise ValueError(f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens {req.params.max_new_tokens} "
                         f"needs {need} KV slots, more than this rank's capacity of {capacity} "
                         f"(raise engine.kv_budget_mb or shorten the request)")


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: KVPool, eos_id: int, decode_tail, conservativeness: float = 1.0):
        self.cfg, self.pool, self.eos_id, self.decode_tail = cfg, pool, eos_id, decode_tail
        self.cache = RadixCache(pool.free, enabled=cfg.radix_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []          # decoding
        self.chunked: Req | None = None        # a request mid-prefill
        self.conservativeness = conservativeness
        self.new_token_ratio = self._init_ratio = min(1.0, cfg.new_token_ratio * conservativeness)
        self.min_ratio = min(self._init_ratio, cfg.min_new_token_ratio * conservativeness)
        self._last_mode: ForwardMode | None = None
        self.stats = {"retractions": 0, "extend_steps": 0, "decode_steps": 0, "max_running_requests": 0}

    # -- intake ------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a request. Raises ValueError (one clear sentence) when it can never fit on this rank."""
        check_admissible(req, self.pool.capacity)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + (self.chunked is not None)

    # -- batch formation ---------------------------------------------------------------------------------
    def next_batch(self) -> ForwardBatch | None:
        batch = None
        prefill_first = not (self._last_mode is ForwardMode.EXTEND and self.running)
        if prefill_first:
            batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        if batch is None and not prefill_first:     # every decode was retracted: the prefill goes on now
            batch = self._prefill_batch()
        self._last_mode = batch.mode if batch else None
        return batch

    def _reserved_tokens(self, reqs) -> float:
        return sum(min(r.remaining_new_tokens, 4096) * self.new_token_ratio for r in reqs)

    def _prefill_batch(self) -> ForwardBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        budget = self.cfg.chunked_prefill_tokens
        # KV this step may promise: free + evictable, less what running requests will still decode (by ratio)
        # and what requests admitted now (incl. a continuing chunk) will still extend and decode
        promised = self._reserved_tokens(self.running)
        admitted: list[tuple[Req, int]] = []      # (req, tokens to extend this step)
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            left = len(req.fill_ids) - req.kv_slots.shape[0]
            admitted.append((req, min(budget, left)))
            promised += left + self._reserved_tokens([req])
            budget -= admitted[-1][1]
        if self.cfg.schedule_policy == "lpm" and 1 < len(self.waiting) <= 128:   # SGLang: fcfs beyond 128
            lengths = {id(r): self.cache.match_prefix(r.fill_ids[:-1])[0].shape[0] for r in self.waiting}
            self.waiting.sort(key=lambda r: -lengths[id(r)])
        while self.waiting and budget > 0:
            if len(self.running) + len(admitted) >= self.cfg.max_running_requests:
                break
            req = self.waiting[0]
            slots, node = self.cache.match_prefix(req.fill_ids[:-1])
            extend = len(req.fill_ids) - slots.shape[0]
            cost = extend + self._reserved_tokens([req])
            self.cache.inc_lock_ref(node)               # locking shrinks what eviction could free
            if cost > self.pool.available() + self.cache.evictable_size() - promised:
                self.cache.dec_lock_ref(node)
                break                                   # wait: admitting it could over-commit the pool
            self.waiting.pop(0)
            req.kv_slots, req.prefix_len, req.last_node = slots, slots.shape[0], node
            if req.cached_tokens < 0:
                req.cached_tokens = min(slots.shape[0], len(req.prompt_ids))
            n = min(budget, extend)
            admitted.append((req, n))
            promised += cost
            budget -= n
            if n < extend:
                break                                   # the rest of it goes in later chunks
        if not admitted:
            return None
        out_slots = self._alloc(sum(n for _, n in admitted))
        return self._build_extend(admitted, out_slots)

    def _build_extend(self, admitted, out_slots) -> ForwardBatch:
        ids, pos, kv_slots, lens, sample, off = [], [], [], [], [], 0
        for req, n in admitted:
            start = req.kv_slots.shape[0]
            new = out_slots[off:off + n]
            off += n
            req.kv_slots = torch.cat([req.kv_slots, new])
            ids.extend(req.fill_ids[start:start + n])
            pos.extend(range(start, start + n))
            kv_slots.append(req.kv_slots)
            lens.append(n)
            done = req.kv_slots.shape[0] == len(req.fill_ids)
            sample.append(done)
            if not done:
                self.chunked = req
        return ForwardBatch(ForwardMode.EXTEND, reqs=[r for r, _ in admitted], input_ids=torch.tensor(ids),
                            positions=torch.tensor(pos), out_cache_loc=out_slots, extend_lens=lens,
                            kv_slots=kv_slots, sample=sample)

    def _decode_batch(self) -> ForwardBatch | None:
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)
        while self.pool.available() < len(self.running):    # evict, then retract the newest, until all fit
            if self.cache.evict(len(self.running) - self.pool.available()) == 0:
                self._retract_one()
        if not self.running:        # all retracted (a chunked prefill holds the pool): let the prefill go on
            return None
        reqs = list(self.running)
        out_slots = self.pool.alloc(len(reqs))
        lengths = []
        for req, slot in zip(reqs, out_slots):
            req.kv_slots = torch.cat([req.kv_slots, slot.view(1)])
            lengths.append(req.kv_slots.shape[0])
        width = max(lengths)
        padded = torch.zeros(len(reqs), width, dtype=torch.long)
        for i, req in enumerate(reqs):
            padded[i, : lengths[i]] = req.kv_slots
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return ForwardBatch(ForwardMode.DECODE, reqs=reqs, input_ids=torch.tensor([r.fill_ids[-1] for r in reqs]),
                            positions=torch.tensor(lengths) - 1, out_cache_loc=out_slots, extend_lens=[1] * len(reqs),
                            padded_slots=padded, padded_mask=mask, sample=[True] * len(reqs))

    def _retract_one(self) -> None:
        """Free the newest running request's KV (into the radix cache) and queue it to resume first."""
        if not self.running:
            raise RuntimeError("KV pool exhausted with nothing left to retract; admission should have refused this")
        req = self.running.pop()
        self.cache.cache_req(req, keep_lock=False)
        req.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.insert(0, req)
        # SGLang's retract_decode: re-estimate the ratio from what the remaining requests have decoded so far,
        # plus 20 steps' worth of headroom each
        if self.running:
            decoded = sum(len(r.output_ids) for r in self.running)
            budget = sum(r.params.max_new_tokens for r in self.running)
            self.new_token_ratio = min(1.0, (decoded + 20 * len(self.running)) / budget)

    def _alloc(self, n: int) -> torch.Tensor:
        """n slots: evict unlocked cache entries first, then retract running requests (never over-commit)."""
        while self.pool.available() < n:
            if self.cache.evict(n - self.pool.available()) == 0:
                self._retract_one()
        return self.pool.alloc(n)

    # -- results -----------------------------------------------------------------------------------------
    def process(self, batch: ForwardBatch, next_tokens: list[int] | None, now: float) -> list[Req]:
        """Record the step's sampled tokens (one per request with sample=True). Returns the requests that got a
        token this step (finished ones included)."""
        if batch.mode.is_idle():
            return []
        self.stats["extend_steps" if batch.mode.is_extend() else "decode_steps"] += 1
        emitted, tokens = [], iter(next_tokens or [])
        for req, sample in zip(batch.reqs, batch.sample):
            if not sample:
                self.cache.cache_req(req, keep_lock=True)    # a prefill chunk: publish it, keep reading it
                continue
            req.output_ids.append(next(tokens))
            if req.first_token_time is None:
                req.first_token_time = now
            req.check_finished(self.eos_id, self.decode_tail)
            emitted.append(req)
            if req.finished:
                req.finish_time = now
                self.cache.cache_req(req, keep_lock=False)
                if req in self.running:
                    self.running.remove(req)
            elif batch.mode.is_extend():
                self.running.append(req)
        self.stats["max_running_requests"] = max(self.stats["max_running_requests"], len(self.running))
        return emitted

    def abort(self, rid: str) -> Req | None:
        """Drop a request (client gone): free what it holds."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if req.kv_slots.numel():
                        self.cache.cache_req(req, keep_lock=False)
                    req.finish_reason = "abort"
                    return req
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self.cache.cache_req(req, keep_lock=False)
            req.finish_reason = "abort"
            return req
        return None
