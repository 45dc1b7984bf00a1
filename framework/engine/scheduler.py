"""One rank's scheduler: SGLang v0.4.1's continuous batching (managers/scheduler.py, schedule_batch.py), decision
for decision, over a KV pool, a req_to_token table and a radix cache. docs/fidelity.md lists every difference.

Each step (`get_next_batch_to_run`): the last EXTEND batch joins the running batch (a request mid-prefill is
published to the radix cache instead and continues next step); then a prefill batch runs whenever one can be formed
(schedule_policy.py decides which waiting requests it takes), else one DECODE step for the running batch. A prompt
enters the radix cache right after its prefill, so a request sharing it hits it while the first one still decodes.
When decode runs out of KV, `retract_decode` sends requests back to the tail of the waiting queue (fewest outputs,
then longest prompt, first), keeping 20 free slots per remaining request, and re-estimates new_token_ratio.

The forward pass is not called here: `next_batch()` returns what to run and `process(batch, tokens, now)` takes the
sampled tokens, so a simulator can drive the same scheduler with a cost model. No wall-clock is read here.

`engine.scheduler=vllm_v0_1_7` hands each step's decisions to vLLM's rules (framework/engine/vllm_policy.py) over the
same queues, pool and batch builders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.contracts.batch import ForwardBatch, ForwardMode
from framework.engine.config import EngineConfig, EngineScheduler, Role, sglang_max_running_requests
from framework.engine.disagg import Disaggregation
from framework.engine.kv_pool import KVPool
from framework.engine.radix_cache import RadixCache
from framework.engine.request import Req
from framework.engine.schedule_policy import AddReqResult, PrefillAdder, calc_priority, prefix_key
from framework.engine.stats import HitRateLog
from framework.engine.vllm_policy import VllmScheduling

RETRACT_DECODE_STEPS = 20    # global_config.retract_decode_steps: free slots kept per request after a retraction


def check_admissible(req: Req, capacity: int | None, context_len: int | None = None) -> None:
    """Raise ValueError, in one sentence, for a request that could never run on a rank of `capacity` KV slots.
    SGLang's limit (max_req_len = min(context, capacity) - 1, and max_new_tokens < max_req_len - prompt): a prompt
    plus max_new_tokens of at most min(context, capacity) - 2 tokens. SGLang clips max_new_tokens to it; servelab
    refuses the request instead, so nothing is cut short silently."""
    req.params.validate()
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    need = len(req.prompt_ids) + req.params.max_new_tokens
    for limit, what in ((capacity, "KV capacity"), (context_len, "context length")):
        if limit is not None and need > limit - 2:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens {req.params.max_new_tokens} "
                             f"= {need} tokens, more than a request may hold on this rank: {limit - 2} (its {what} "
                             f"of {limit} tokens less 2, as SGLang; raise engine.kv_budget_mb or shorten the request)")


@dataclass(frozen=True)
class StepRecord:
    """One scheduling decision, for tests and replays (`Scheduler.step_log`)."""
    mode: str                        # extend | decode
    rids: tuple[str, ...]            # the batch, in order
    prefix_lens: tuple[int, ...]     # extend: cached tokens each request starts from
    extend_lens: tuple[int, ...]     # extend: tokens each request runs
    retracted: tuple[str, ...]       # decode: requests sent back to the waiting queue, in order
    new_token_ratio: float           # after this step's decisions


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: KVPool, eos_id: int, decode_tail, conservativeness: float = 1.0,
                 context_len: int | None = None):
        """conservativeness: SGLang's schedule_conservativeness (the parallelism plugin's). context_len: the most
        tokens one request may hold (the model's context; default: the pool's capacity)."""
        self.cfg, self.pool, self.eos_id, self.decode_tail = cfg, pool, eos_id, decode_tail
        self.context_len = context_len
        self.max_running = (cfg.max_running_requests if cfg.max_running_requests is not None
                            else sglang_max_running_requests(pool.capacity, context_len or pool.capacity))
        # engine.scheduler=vllm_*: vLLM's decisions over these queues and this pool (framework/engine/vllm_policy.py)
        self.vllm = (VllmScheduling(cfg, pool.capacity, self.max_running)
                     if cfg.scheduler != EngineScheduler.sglang else None)
        self.req_to_token = pool.req_to_token_pool(self.max_running, min(context_len or pool.capacity, pool.capacity))
        self.cache = RadixCache(pool.free, self.req_to_token, enabled=cfg.radix_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []          # SGLang's running batch: finished requests leave it at the next decode
        self.chunked: Req | None = None        # the request mid-prefill (SGLang's being_chunked_req)
        self.batch_is_full = False
        self._last_extend: list[Req] | None = None    # the last EXTEND batch, merged into `running` next step
        self._last_mode: ForwardMode | None = None
        self._no_step = False                 # the last next_batch() ran nothing and no IDLE step followed
        self.init_new_token_ratio = min(cfg.init_new_token_ratio * conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * cfg.min_new_token_ratio_factor, 1.0)
        self.new_token_ratio_decay = ((self.init_new_token_ratio - self.min_new_token_ratio)
                                      / cfg.new_token_ratio_decay_steps)
        self.new_token_ratio = self.init_new_token_ratio
        # engine_ttft_s: the seconds from each request's arrival at the engine to its first token, summed over
        # first_tokens requests (the part of a TTFT spent in the engine: its queue and its prefill steps). Arrival is
        # stamped by the HTTP worker after tokenizing, on its host's monotonic clock: one host's figure (a rank on
        # another machine reads another clock). Not comparable under prefill/decode disaggregation: a decode
        # instance's first token (disagg.py) is not counted, and the simulator re-stamps a paired prefill's arrival
        # when its decode slots are known, where the real one counts that wait
        self.stats = {"retractions": 0, "prefill_retractions": 0, "extend_steps": 0, "decode_steps": 0,
                      "max_running_requests": 0, "cache_hit_tokens": 0, "cache_prefill_tokens": 0,
                      "engine_ttft_s": 0.0, "first_tokens": 0}
        self.hit_log = HitRateLog(self.stats)     # SGLang's tree_cache_metrics, and its hit rate over time
        self.fidelity = {"alternate_extend_decode": cfg.alternate_extend_decode}   # switches off SGLang's path
        self.step_log: list[StepRecord] | None = None    # tests and replays set a list
        # a prefill or decode instance's queues (framework/engine/disagg.py); None on a mixed one
        self.disagg = (Disaggregation(self, cfg.role, cfg.disaggregation_decode_prefix_reuse)
                       if cfg.role != Role.mixed else None)

    # -- intake ------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a request. Raises ValueError (one clear sentence) when it can never fit on this rank."""
        check_admissible(req, self.pool.capacity, self.context_len)
        if self.vllm is not None:
            self.vllm.check_admissible(req)
        self.waiting.append(req)

    def add_paired(self, req: Req) -> None:
        """Queue a request that carries a prefill/decode pairing (its role's path: framework/engine/disagg.py)."""
        if self.disagg is None:
            self.add(req)                     # a mixed instance serves it whole (SGLang's ignores the fields too)
        else:
            if self.disagg.role is Role.decode:   # (a prefill request is checked by add, with max_new_tokens 1)
                check_admissible(req, self.pool.capacity, self.context_len)
            self.disagg.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._last_extend)

    def num_running(self) -> int:
        """Requests past admission and not finished: decoding, just prefilled, or mid-prefill."""
        new = [r for r in self._last_extend or () if r is not self.chunked]
        return sum(not r.finished for r in self.running + new) + (self.chunked is not None)

    def num_requests(self) -> int:
        return len(self.waiting) + self.num_running()

    # -- batch formation (get_next_batch_to_run) -------------------------------------------------------------
    def next_batch(self) -> ForwardBatch | None:
        if self._no_step:                     # SGLang resets the ratio in every loop iteration that ran no batch
            self.new_token_ratio = self.init_new_token_ratio
        self._merge_last_extend()
        if self.disagg is not None:
            self.disagg.preallocate()
        retracted: list[Req] = []
        if self.vllm is not None:
            batch = self.vllm.next_batch(self, retracted)
        elif self.cfg.alternate_extend_decode and self._last_mode is ForwardMode.EXTEND and self.running:
            batch = self._decode_batch(retracted) or self._prefill_batch()
        else:
            batch = self._prefill_batch() or self._decode_batch(retracted)
        self._last_mode = batch.mode if batch is not None else None
        self._no_step = batch is None
        if batch is not None:
            self.stats["max_running_requests"] = max(self.stats["max_running_requests"], self.num_running())
            if self.step_log is not None:
                self.step_log.append(StepRecord(batch.mode.value, tuple(r.rid for r in batch.reqs),
                                                tuple(batch.prefix_lens), tuple(batch.extend_lens),
                                                tuple(r.rid for r in retracted), self.new_token_ratio))
        return batch

    def _merge_last_extend(self) -> None:
        reqs, self._last_extend = self._last_extend, None
        if reqs is None:
            return
        if self.chunked is not None:          # publish its chunk; SGLang also drops finished ones here
            reqs = [r for r in reqs if not r.finished and r is not self.chunked]
            self.cache.cache_unfinished_req(self.chunked)
            self.batch_is_full = False
        self.running += reqs

    def _prefill_batch(self) -> ForwardBatch | None:
        """SGLang's get_new_batch_prefill."""
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.running)
        if running_bs >= self.max_running:
            self.batch_is_full = True
            return None
        prefix_computed = calc_priority(self.cfg.schedule_policy, self.cache, self.waiting)
        adder = PrefillAdder(self.cache, self.running, self.new_token_ratio,
                             self.pool.available() + self.cache.evictable_size(), self.cfg.max_prefill_tokens,
                             self.cfg.chunked_prefill_tokens)
        continued = self.chunked
        if self.chunked is not None:
            self.chunked.extend_input_len = len(self.chunked.prompt_ids) + len(self.chunked.output_ids) - \
                len(self.chunked.prefix_indices)
            self.chunked = adder.add_being_chunked_req(self.chunked)
        for req in self.waiting:
            if running_bs + len(adder.can_run_list) >= self.max_running:
                self.batch_is_full = True
                break
            if not prefix_computed:
                req.prefix_indices, req.last_node = self.cache.match_prefix(prefix_key(req))
            req.extend_input_len = len(req.prompt_ids) + len(req.output_ids) - len(req.prefix_indices)
            res = adder.add_one_req(req)
            if res is not AddReqResult.CONTINUE:
                self.batch_is_full = self.batch_is_full or res is AddReqResult.NO_TOKEN
                break
        if not adder.can_run_list:
            return None
        taken = {id(r) for r in adder.can_run_list}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        if adder.new_being_chunked_req is not None:
            self.chunked = adder.new_being_chunked_req
        self.hit_log.prefill(adder.can_run_list, continued)
        return self._build_extend(adder.can_run_list)

    def _build_extend(self, reqs: list[Req]) -> ForwardBatch:
        """SGLang's prepare_for_extend: a row per new request holding its cached prefix, then slots for the new
        tokens, written in place."""
        out = self._alloc_extend(sum(r.extend_input_len for r in reqs))
        ids, pos, prefix_lens, sample, off = [], [], [], [], 0
        inputs = self.pool.holds_kv  # a counting pool (the simulator) runs no forward: no token ids to gather
        for req in reqs:
            start, n = len(req.prefix_indices), req.extend_input_len
            if req.req_pool_idx == 0:         # new or resumed (a request mid-prefill keeps its row)
                req.req_pool_idx = self.req_to_token.alloc()
                self.req_to_token.write(req.req_pool_idx, 0, req.prefix_indices)
                if req.cached_tokens < 0:
                    req.cached_tokens = start
            self.req_to_token.write(req.req_pool_idx, start, out[off:off + n])
            off += n
            req.kv_len = start + n
            if inputs:
                fill = req.prompt_ids if start + n <= len(req.prompt_ids) else req.fill_ids
                ids += fill[start:start + n]
                pos += range(start, start + n)
            prefix_lens.append(start)
            sample.append(req is not self.chunked)
        return ForwardBatch(ForwardMode.EXTEND, reqs=list(reqs), input_ids=torch.tensor(ids, dtype=torch.long),
                            positions=torch.tensor(pos, dtype=torch.long), out_cache_loc=out,
                            req_to_token=self.req_to_token.table,
                            req_pool_indices_cpu=[r.req_pool_idx for r in reqs], seq_lens_cpu=[r.kv_len for r in reqs],
                            prefix_lens=prefix_lens, extend_lens=[r.extend_input_len for r in reqs], sample=sample)

    def _alloc_extend(self, n: int) -> torch.Tensor:
        """alloc_token_slots: free slots, else evict n from the tree. SGLang stops with an out-of-memory error
        past that (its admission leaves no way there when prefills run first); servelab retracts decodes instead,
        which only alternate_extend_decode can need."""
        out = self.pool.alloc(n)
        if out is None:
            self.cache.evict(n)
            out = self.pool.alloc(n)
        while out is None:
            live = [r for r in self.running if not r.finished]
            if not live:
                raise RuntimeError(f"KV pool exhausted: a prefill needs {n} slots, {self.pool.available()} are free "
                                   f"and no running request is left to retract")
            victim = live[_retract_order(live)[-1]]
            self.running.remove(victim)
            self._retract(victim)
            self.waiting.append(victim)
            self.stats["prefill_retractions"] += 1
            self.cache.evict(n - self.pool.available())
            out = self.pool.alloc(n)
        return out

    def _decode_batch(self, retracted: list[Req]) -> ForwardBatch | None:
        """SGLang's update_running_batch + prepare_for_decode."""
        if not self.running:
            return None
        initial_bs = len(self.running)
        self.running = [r for r in self.running if not r.finished]
        if not self.running:
            self.batch_is_full = False
            return None
        if not self._check_decode_mem():
            retracted += self._retract_decode()
            self.waiting += retracted
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if len(self.running) < initial_bs:
            self.batch_is_full = False
        if not self.running:
            return None
        return self._build_decode()

    def _build_decode(self) -> ForwardBatch:
        """SGLang's prepare_for_decode: one new slot per running request (the caller made room)."""
        reqs = list(self.running)
        bs = len(reqs)
        out = self.pool.alloc(bs)
        rows = [r.req_pool_idx for r in reqs]
        positions = [r.kv_len for r in reqs]
        self.req_to_token.write_tokens(rows, positions, out)
        for r in reqs:
            r.kv_len += 1
        last = [r.output_ids[-1] for r in reqs] if self.pool.holds_kv else []  # the simulator runs no forward
        return ForwardBatch(ForwardMode.DECODE, reqs=reqs, input_ids=torch.tensor(last, dtype=torch.long),
                            positions=torch.tensor(positions if last else [], dtype=torch.long), out_cache_loc=out,
                            req_to_token=self.req_to_token.table, req_pool_indices_cpu=rows,
                            seq_lens_cpu=[p + 1 for p in positions],
                            extend_lens=[1] * bs, sample=[True] * bs)

    # -- runs of decode steps, advanced at once (the simulator) ------------------------------------------------
    def decode_steps_ahead(self) -> int:
        """How many of the next steps are certain to be DECODE steps of the running batch as it stands, none but the
        last of them finishing a request: no prefill can be formed (nothing waits, or batch_is_full), nothing is
        mid-prefill, just prefilled or finished, no request has stop strings, and the free slots cover the steps
        without an eviction. 0 when the next step may be anything else (or there is none)."""
        if self.vllm is not None:
            return self.vllm.decode_steps_ahead(self)
        if (self.chunked is not None or self._last_extend is not None or self._no_step or not self.running
                or (self.waiting and not self.batch_is_full)):
            return 0
        ahead = self.pool.available() // len(self.running)
        for r in self.running:
            if r.finished or r.params.stop:
                return 0
            ahead = min(ahead, r.params.max_new_tokens - len(r.output_ids))
        return ahead

    def advance_decode(self, k: int, tokens, now: float) -> list[Req]:
        """Run k DECODE steps (1 <= k <= decode_steps_ahead()) with exactly the effects of k rounds of next_batch()
        and process(), in O(batch) Python instead of O(k x batch), without building the batches. `tokens(req, k)`:
        the request's k sampled tokens (an EOS before the last of them is refused); `now`: when the last step ends.
        Returns the batch; every request in it got k tokens, the last step may have finished some."""
        ahead = self.decode_steps_ahead()
        if not 1 <= k <= ahead:
            raise ValueError(f"advance_decode({k}): {ahead} plain decode step(s) are certain from here")
        reqs = self.running
        new = [tokens(r, k) for r in reqs]
        if any(not r.params.ignore_eos and self.eos_id in toks[:-1] for r, toks in zip(reqs, new)):
            raise ValueError("advance_decode: a token before the last ends a request (EOS); step one at a time")
        self.stats["max_running_requests"] = max(self.stats["max_running_requests"], self.num_running())
        bs = len(reqs)
        rows = [r.req_pool_idx for r in reqs]
        for j in range(k):
            self.req_to_token.write_tokens(rows, [r.kv_len + j for r in reqs], self.pool.alloc(bs))
        for _ in range(k):
            if self.vllm is None:             # SGLang's decay per decode step (vLLM has no such ratio)
                self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
            if self.step_log is not None:
                self.step_log.append(StepRecord("decode", tuple(r.rid for r in reqs), (), (1,) * bs, (),
                                                self.new_token_ratio))
        for req, toks in zip(reqs, new):
            req.kv_len += k
            req.output_ids += toks
            req.check_finished(self.eos_id, self.decode_tail)
            if req.finished:
                req.finish_time = now
                self.cache.cache_finished_req(req)
        self.stats["decode_steps"] += k
        return list(reqs)

    def _check_decode_mem(self) -> bool:
        bs = len(self.running)
        if self.pool.available() >= bs:
            return True
        self.cache.evict(bs)
        return self.pool.available() >= bs

    def _retract_decode(self) -> list[Req]:
        """SGLang's retract_decode: retract the requests with the fewest outputs (then the longest prompts) until
        20 slots per remaining request are free, at least one; the batch keeps that sorted order. SGLang never
        retracts the last request (it asserts a free slot); servelab does when no slot is free."""
        reqs = self.running
        order = _retract_order(reqs)
        retracted, first = [], True
        while self.pool.available() < len(order) * RETRACT_DECODE_STEPS or first:
            if len(order) == 1 and self.pool.available() > 0:
                break
            first = False
            req = reqs[order.pop()]
            self._retract(req)
            retracted.append(req)
            self.cache.evict(max(0, len(order) * RETRACT_DECODE_STEPS - self.pool.available()))
            if not order:
                break
        if retracted:
            self.running = [reqs[i] for i in order]
        if self.running:
            decoded = sum(len(r.output_ids) for r in self.running)
            budget = sum(r.params.max_new_tokens for r in self.running)
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / budget)
        return retracted

    def _retract(self, req: Req) -> None:
        """Free what the request holds beyond the radix cache (with the cache off: everything), its row and its
        lock; it keeps its outputs and is prefilled again when re-admitted."""
        start = len(req.prefix_indices) if self.cache.enabled else 0
        self.pool.free(self.req_to_token.slots(req.req_pool_idx, req.kv_len, start))
        self.req_to_token.free(req.req_pool_idx)
        if self.cache.enabled:
            self.cache.dec_lock_ref(req.last_node)
        req.release_kv()
        req.retractions += 1
        self.stats["retractions"] += 1

    # -- results (process_batch_result) ----------------------------------------------------------------------
    def process(self, batch: ForwardBatch, next_tokens: list[int] | None, now: float) -> list[Req]:
        """Record the step's sampled tokens (one per request with sample=True). Returns the requests that got a
        token this step (finished ones included)."""
        if batch.mode.is_idle():
            self._no_step = False             # a step ran (this rank idled while others worked)
            return []
        extend = batch.mode.is_extend()
        self.stats["extend_steps" if extend else "decode_steps"] += 1
        emitted, tokens = [], iter(next_tokens or [])
        for req, sample in zip(batch.reqs, batch.sample):
            if not sample:
                continue                      # a prefill chunk that is not the last: published at the next step
            req.output_ids.append(next(tokens))
            if req.first_token_time is None:
                req.first_token_time, req.engine_ttft_s = now, now - req.arrival_time
                self.stats["engine_ttft_s"] += req.engine_ttft_s
                self.stats["first_tokens"] += 1
            req.check_finished(self.eos_id, self.decode_tail)
            emitted.append(req)
            if req.finished:
                req.finish_time = now
                if self.disagg is None or not self.disagg.hold(req):
                    self.cache.cache_finished_req(req)
            elif extend:
                self.cache.cache_unfinished_req(req)
        if extend:
            self._last_extend = batch.reqs
            self.hit_log.stamp(now)
        return emitted

    def abort(self, rid: str) -> Req | None:
        """Drop an unfinished request (client gone): what it computed goes to the radix cache, the rest is freed."""
        if self.disagg is not None and self.disagg.abort(rid):
            return None
        queues = (self.waiting, self.running, self._last_extend or [])
        candidates = [r for q in queues for r in q] + ([self.chunked] if self.chunked else [])
        req = next((r for r in candidates if r.rid == rid and not r.finished), None)
        if req is None:
            return None
        for queue in queues:
            if req in queue:
                queue.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req.req_pool_idx:
            self.cache.cache_finished_req(req)
        self.batch_is_full = False
        req.finish_reason = "abort"
        return req


def _retract_order(reqs: list[Req]) -> list[int]:
    """Indices in retract_decode's order: the last one goes first (fewest outputs, then longest prompt; among
    equals the later one in the batch)."""
    return sorted(range(len(reqs)), key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].prompt_ids)), reverse=True)
