"""vLLM's own scheduler, as DistServe's artifact ran it for its vLLM baseline: `engine.scheduler=vllm_v0_1_7`.

Which vLLM. DistServe's artifact (LLMServe/DistServe at e2d4dca, the commit whose plot.ipynb prints Figure 8) builds
its baseline from `git clone https://github.com/interestingLSY/vllm.git --branch distserve-baseline-vllm`
(evaluation/README.md, evaluation/Dockerfile.evaluation). That branch's head (a4b2b944, 2024-04-29) is vLLM v0.1.7
(`vllm/__init__.py`: "0.1.7") plus timing patches that leave the scheduler alone; the notebook that prints the
figure was committed after it (cc3096f, 2024-04-30). The artifact's INSTRUCTIONS.md says "v0.2.3" and a sibling
branch `distserve-baseline-vllm-v0.2.3` exists: v0.2.3 differs from v0.1.7 in its prefill admission only (a padded
count, len(batch) x longest prompt <= max_num_batched_tokens, and at most max_paddings = 256 padding tokens) and pads
prompts in the forward; that variant is not built here.

The rules, each from `vllm/core/scheduler.py` (Scheduler._schedule) and `vllm/core/block_manager.py`
(BlockSpaceManager) at distserve-baseline-vllm, with the artifact's settings (2-start-api-server.py:
`--block-size 16 --swap-space 16 --max-num-batched-tokens 16384 --max-num-seqs 1024`, TP 1 for OPT-13B):
- a step is all prefill or all decode: while nothing is swapped out, waiting requests are admitted from the head of
  the queue (FCFS, no reordering, stop at the first that does not fit) and, when any was, the step is a prefill of
  exactly those (no chunking); else one decode step of every running request;
- admission stops when the prompt's blocks (ceil(tokens / block_size), the whole sequence: a preempted request's
  outputs too) would leave fewer free blocks than the watermark (`can_allocate`: free - needed >= int(0.01 x
  blocks)), when the batch's prompt tokens would pass max_num_batched_tokens (here `engine.max_prefill_tokens`), or
  when the running requests would pass max_num_seqs (here the scheduler's max_running_requests);
- decode: the running requests in arrival order (`policy.py` FCFS); each needs one free block to go on
  (`can_append_slot`, whether or not its last block is full) and takes a new one when its last block is full
  (`append_slot`); while none is free the latest-arrived running request is preempted, and the request itself when
  none is left;
- preemption is recomputation for a single-sequence request (`_preempt`: n = best_of = 1 in the artifact's client):
  its blocks are freed and it goes to the FRONT of the waiting queue, prefilled again over prompt and outputs. The
  swap space (16 GiB) serves only multi-sequence groups, so it is never used here;
- no prefix caching (v0.1.7 has none): `engine.radix_cache=false` is required.
The KV pool's tokens are counted in blocks of `engine.vllm_block_size`: vLLM's num_gpu_blocks = the pool's tokens //
block size. Not modelled: vLLM's profiling run's activation memory (its blocks come from what is left after a
16,384-token forward), the API server's and Ray's overheads, the FINISHED_IGNORED path (a request vLLM would drop is
refused at `add` instead, as the SGLang path refuses what it cannot run).
"""
from __future__ import annotations

from framework.contracts.batch import ForwardBatch


def blocks(tokens: int, block_size: int) -> int:
    """Blocks holding `tokens` tokens (a sequence's logical_token_blocks)."""
    return -(-tokens // block_size)


class VllmScheduling:
    """The decisions of vLLM v0.1.7's scheduler over a servelab Scheduler's queues, pool and batch builders (the
    Scheduler calls in here when `engine.scheduler` names vLLM; this module imports nothing of it)."""

    def __init__(self, cfg, capacity: int, max_num_seqs: int):
        self.block_size = cfg.vllm_block_size
        self.total_blocks = capacity // self.block_size
        self.watermark_blocks = int(cfg.vllm_watermark * self.total_blocks)
        self.max_num_batched_tokens = cfg.max_prefill_tokens
        self.max_num_seqs = max_num_seqs

    def free_blocks(self, running) -> int:
        return self.total_blocks - sum(blocks(r.kv_len, self.block_size) for r in running)

    def check_admissible(self, req) -> None:
        """Raise ValueError for a request vLLM would drop or never run: longer, outputs included, than
        max_num_batched_tokens (vLLM ignores a prompt past it and requires max_model_len <= it, so a preempted request
        always fits again), or needing more blocks than the watermark leaves in an empty pool (v0.1.7 would wait
        for it forever)."""
        need = len(req.prompt_ids) + req.params.max_new_tokens
        if need > self.max_num_batched_tokens:
            raise ValueError(f"prompt + max_new_tokens = {need} tokens, more than vLLM's max_num_batched_tokens "
                             f"(engine.max_prefill_tokens) of {self.max_num_batched_tokens}")
        if blocks(need, self.block_size) > self.total_blocks - self.watermark_blocks:
            raise ValueError(f"prompt + max_new_tokens = {need} tokens need {blocks(need, self.block_size)} blocks "
                             f"of {self.block_size}; the pool has {self.total_blocks}, less the watermark's "
                             f"{self.watermark_blocks}")

    # -- one step ----------------------------------------------------------------------------------------------
    def next_batch(self, s, retracted: list) -> ForwardBatch | None:
        s.running = [r for r in s.running if not r.finished]      # free_finished_seq_groups after every step
        return self._prefill(s) or self._decode(s, retracted)

    def _admissible(self, req, free: int, batched: int, num_seqs: int) -> bool:
        n = len(req.fill_ids)
        return (free - blocks(n, self.block_size) >= self.watermark_blocks          # can_allocate
                and batched + n <= self.max_num_batched_tokens
                and num_seqs + 1 <= self.max_num_seqs)

    def _prefill(self, s) -> ForwardBatch | None:
        free, batched, admitted = self.free_blocks(s.running), 0, []
        for req in s.waiting:
            if not self._admissible(req, free, batched, len(s.running) + len(admitted)):
                break
            req.extend_input_len = len(req.fill_ids)
            free -= blocks(req.extend_input_len, self.block_size)
            batched += req.extend_input_len
            admitted.append(req)
        if not admitted:
            return None
        del s.waiting[:len(admitted)]
        s.hit_log.prefill(admitted, None)
        return s._build_extend(admitted)

    def _decode(self, s, retracted: list) -> ForwardBatch | None:
        queue = sorted(s.running, key=lambda r: r.arrival_time)   # FCFS: the earliest arrival first (stable)
        free, kept, preempted = self.free_blocks(queue), [], []
        while queue:
            req = queue.pop(0)
            while free < 1:                                        # can_append_slot: a free block per sequence
                victim = queue.pop() if queue else req             # the latest arrival, else the request itself
                free += blocks(victim.kv_len, self.block_size)
                s._retract(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                if req.kv_len % self.block_size == 0:              # append_slot: its last block is full
                    free -= 1
                kept.append(req)
        s.waiting[:0] = preempted[::-1]      # each victim goes to the front: the earliest arrival ends up first
        retracted += preempted
        s.running = kept
        return s._build_decode() if kept else None

    # -- runs of decode steps (the simulator) ------------------------------------------------------------------
    def decode_steps_ahead(self, s) -> int:
        """Steps certain to be plain DECODE steps of the running batch, none but the last finishing a request (see
        Scheduler.decode_steps_ahead). The waiting head that cannot be admitted now cannot be during the run (free
        blocks only shrink); the run keeps at least one block free after each step (the exact rule can take the
        last one: that step is then taken one at a time)."""
        if s._last_extend is not None or s._no_step or not s.running:
            return 0
        if s.waiting and self._admissible(s.waiting[0], self.free_blocks(s.running), 0, len(s.running)):
            return 0
        ahead = min(r.params.max_new_tokens - len(r.output_ids) for r in s.running)
        if any(r.finished or r.params.stop for r in s.running) or ahead < 1:
            return 0
        budget, bs = self.free_blocks(s.running) - 1, self.block_size

        def new_blocks(k: int) -> int:
            return sum(blocks(r.kv_len + k, bs) - blocks(r.kv_len, bs) for r in s.running)

        lo, hi = 0, ahead                       # the largest k with new_blocks(k) <= budget (monotone in k)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if new_blocks(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo
