"""The oracle for the scheduler tests: SGLang v0.4.1's scheduling decisions, re-implemented plainly and apart from
servelab's code. Read from SGLang v0.4.1 (commit efc52f85): managers/scheduler.py (Scheduler.__init__'s ratios,
event_loop_normal, get_next_batch_to_run, get_new_batch_prefill, update_running_batch,
process_batch_result_prefill/_decode), managers/schedule_policy.py (SchedulePolicy.calc_priority, PrefillAdder),
managers/schedule_batch.py (Req.init_next_round_input, ScheduleBatch.check_decode_mem, retract_decode,
filter_batch) and mem_cache/radix_cache.py (cache_finished_req, cache_unfinished_req, lock accounting).

It counts tokens instead of holding KV slots, and keeps the radix cache as a token-level trie (no edges, no LRU):
scenarios that would make SGLang evict, crash or hang raise NotModelled instead of guessing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CLIP = 4096           # CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_STEPS = 20    # global_config.retract_decode_steps
IN_BATCH_CHECK = IN_BATCH_DEPRIORITIZE = 32
TOKEN = 7             # what every step samples (the tests feed the engine the same)


class NotModelled(Exception):
    """The scenario left what this oracle models (eviction, SGLang's OOM exit or assertion)."""


@dataclass(eq=False)
class OReq:
    rid: str
    prompt: tuple
    max_new: int
    ignore_eos: bool = True
    out: int = 0
    prefix: int = 0                  # len(prefix_indices)
    lock: tuple | None = None        # the tokens whose path last_node stands for
    kv: int = 0                      # seq_len: tokens with KV
    ext: int = 0                     # extend_input_len
    cached_tokens: int = -1
    finished: bool = False

    def fill(self) -> tuple:
        return self.prompt + (TOKEN,) * self.out


class Trie:
    """Cached token prefixes: one node per token; locks count per path."""

    def __init__(self):
        self.root: dict = {}
        self.size = 0
        self.locks: list[tuple] = []

    def match(self, key: tuple) -> int:
        node, n = self.root, 0
        while n < len(key) and key[n] in node:
            node, n = node[key[n]], n + 1
        return n

    def insert(self, key: tuple) -> None:
        node = self.root
        for t in key:
            if t not in node:
                node[t] = {}
                self.size += 1
            node = node[t]

    def protected(self) -> int:
        return len({key[:i] for key in self.locks for i in range(1, len(key) + 1)})

    def lock(self, key: tuple) -> int:
        before = self.protected()
        self.locks.append(key)
        return before - self.protected()          # change of the evictable size

    def unlock(self, key: tuple) -> int:
        before = self.protected()
        self.locks.remove(key)
        return before - self.protected()


@dataclass
class Batch:
    mode: str
    reqs: list
    prefix_lens: tuple = ()
    extend_lens: tuple = ()
    retracted: tuple = ()
    chunking: object = None          # the request whose chunk is not its last


@dataclass
class SGLangV041:
    capacity: int
    chunked_prefill_size: int
    max_prefill_tokens: int = 16384
    max_running_requests: int = 256
    schedule_policy: str = "lpm"
    radix_cache: bool = True
    init_ratio: float = 0.7
    min_ratio_factor: float = 0.14
    decay_steps: float = 600
    schedule_conservativeness: float = 1.0
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    chunked: OReq | None = None
    batch_is_full: bool = False
    last: Batch | None = None

    def __post_init__(self):
        self.tree = Trie()
        self.init_new_token_ratio = min(self.init_ratio * self.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * self.min_ratio_factor, 1.0)
        self.decay = (self.init_new_token_ratio - self.min_new_token_ratio) / self.decay_steps
        self.new_token_ratio = self.init_new_token_ratio
        self.holders: list[OReq] = []

    # -- memory ------------------------------------------------------------------------------------------------
    def available(self) -> int:
        private = sum(r.kv - (r.prefix if self.radix_cache else 0) for r in self.holders)
        return self.capacity - private - self.tree.size

    def evictable(self) -> int:
        return self.tree.size - self.tree.protected()

    def need(self, n: int) -> None:
        """alloc_token_slots / check_decode_mem: evict when short (not modelled)."""
        if self.available() < n and self.evictable() > 0:
            raise NotModelled("eviction")

    # -- one event-loop iteration --------------------------------------------------------------------------------
    def step(self) -> tuple | None:
        batch = self.get_next_batch_to_run()
        self.last = batch
        if batch is None:
            self.new_token_ratio = self.init_new_token_ratio
            return None
        record = (batch.mode, tuple(r.rid for r in batch.reqs), batch.prefix_lens, batch.extend_lens,
                  batch.retracted, self.new_token_ratio)
        self.process(batch)
        return record

    def get_next_batch_to_run(self) -> Batch | None:
        if self.last is not None and self.last.mode == "extend":
            reqs = self.last.reqs
            if self.chunked is not None:
                reqs = [r for r in reqs if not r.finished and r is not self.chunked]
                self.cache_unfinished(self.chunked)
                self.batch_is_full = False
            self.running = self.running + reqs
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if not self.running:
            return None
        return self.update_running_batch()

    def calc_priority(self) -> bool:
        if self.schedule_policy != "lpm" or not self.radix_cache or len(self.waiting) > 128:
            return False
        seen, later = [], set()
        for r in self.waiting:
            key = r.fill()[:-1]
            r.prefix = self.tree.match(key)
            r.lock = key[:r.prefix]
            if r.prefix <= IN_BATCH_CHECK:
                common = max((_lcp(key, k) for k in seen), default=0)
                if common >= IN_BATCH_DEPRIORITIZE:
                    later.add(r.rid)
                else:
                    seen.append(key)
        self.waiting.sort(key=lambda r: float("inf") if r.rid in later else -r.prefix)
        return True

    def get_new_batch_prefill(self) -> Batch | None:
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.running)
        if running_bs >= self.max_running_requests:
            self.batch_is_full = True
            return None
        prefix_computed = self.calc_priority()
        adder = Adder(self, self.available() + self.evictable())
        if self.chunked is not None:
            self.chunked.ext = len(self.chunked.fill()) - self.chunked.prefix
            self.chunked = adder.add_being_chunked_req(self.chunked)
        for r in self.waiting:
            if running_bs + len(adder.can_run) >= self.max_running_requests:
                self.batch_is_full = True
                break
            if not prefix_computed:
                key = r.fill()[:-1]
                r.prefix = self.tree.match(key) if self.radix_cache else 0
                r.lock = key[:r.prefix]
            r.ext = len(r.fill()) - r.prefix
            res = adder.add_one_req(r)
            if res != "continue":
                if res == "no_token":
                    self.batch_is_full = True
                break
        if not adder.can_run:
            return None
        self.waiting = [r for r in self.waiting if r not in adder.can_run]
        if adder.new_chunked is not None:
            self.chunked = adder.new_chunked
        # prepare_for_extend
        n = sum(r.ext for r in adder.can_run)
        self.need(n)
        if self.available() < n:
            raise NotModelled("SGLang exits: prefill out of memory")
        for r in adder.can_run:
            if r not in self.holders:
                self.holders.append(r)
                if r.cached_tokens < 0:
                    r.cached_tokens = r.prefix
            r.kv = r.prefix + r.ext
        return Batch("extend", list(adder.can_run), tuple(r.prefix for r in adder.can_run),
                     tuple(r.ext for r in adder.can_run), chunking=self.chunked)

    def update_running_batch(self) -> Batch | None:
        initial = len(self.running)
        self.running = [r for r in self.running if not r.finished]
        if not self.running:
            self.batch_is_full = False
            return None
        retracted = ()
        bs = len(self.running)
        self.need(bs)
        if self.available() < bs:
            retracted = self.retract_decode()
            self.waiting = self.waiting + list(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_new_token_ratio)
        if len(self.running) < initial:
            self.batch_is_full = False
        for r in self.running:
            r.kv += 1
        return Batch("decode", list(self.running), (), (1,) * len(self.running), tuple(r.rid for r in retracted))

    def retract_decode(self) -> list:
        reqs = self.running
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].out, -len(reqs[i].prompt)), reverse=True)
        retracted, first = [], True
        while self.available() < len(order) * RETRACT_STEPS or first:
            if len(order) == 1:
                if self.available() <= 0:
                    raise NotModelled("SGLang asserts: no space left for the last request")
                break
            first = False
            r = reqs[order.pop()]
            retracted.append(r)
            self.holders.remove(r)
            if self.radix_cache:
                self.tree.unlock(r.lock)
                if len(order) * RETRACT_STEPS - self.available() > 0 and self.evictable() > 0:
                    raise NotModelled("eviction")
            r.prefix, r.lock, r.kv = 0, None, 0
        if len(order) != len(reqs):
            self.running = [reqs[i] for i in order]
        decoded = sum(r.out for r in self.running)
        budget = sum(r.max_new for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_STEPS * len(self.running)) / budget)
        return retracted

    # -- results -------------------------------------------------------------------------------------------------
    def process(self, batch: Batch) -> None:
        for r in batch.reqs:
            if batch.mode == "extend" and r is batch.chunking:
                continue
            r.out += 1
            r.finished = r.out >= r.max_new
            if r.finished:
                self.cache_finished(r)
            elif batch.mode == "extend":
                self.cache_unfinished(r)

    def cache_unfinished(self, r: OReq) -> None:
        if self.radix_cache:
            key = r.fill()[:r.kv]
            self.tree.insert(key)
            self.tree.unlock(r.lock)
            self.tree.lock(key)
            r.lock = key
        r.prefix = r.kv

    def cache_finished(self, r: OReq) -> None:
        if self.radix_cache:
            self.tree.insert(r.fill()[:r.kv])
            self.tree.unlock(r.lock)
        self.holders.remove(r)
        r.prefix, r.lock, r.kv = 0, None, 0


class Adder:
    """PrefillAdder."""

    def __init__(self, s: SGLangV041, rem_total: int):
        self.s = s
        self.rem_total = rem_total - sum(min(r.max_new - r.out, CLIP) * s.new_token_ratio for r in s.running)
        self.cur_rem = rem_total
        self.rem_input = s.max_prefill_tokens
        self.rem_chunk = s.chunked_prefill_size
        self.can_run: list = []
        self.new_chunked = None
        self.states: list | None = None

    def budget_state(self) -> str:
        if self.rem_total <= 0 or self.cur_rem <= 0:
            return "no_token"
        if self.rem_input <= 0 or self.rem_chunk <= 0:
            return "other"
        return "continue"

    def take(self, ext: int, max_new: int) -> None:
        self.rem_total -= ext + max_new
        self.cur_rem -= ext
        self.rem_input -= ext
        self.rem_chunk -= ext

    def add_being_chunked_req(self, r: OReq):
        truncated = r.ext > self.rem_chunk
        r.ext = min(r.ext, self.rem_chunk)
        self.can_run.append(r)
        self.take(r.ext, 0 if truncated else min(r.max_new, CLIP))
        return r if truncated else None

    def add_one_req(self, r: OReq) -> str:
        if r.ignore_eos and not self.s.radix_cache:
            return self.add_one_req_ignore_eos(r)
        total = r.ext + min(r.max_new, CLIP)
        if total >= self.rem_total:
            return "no_token"
        if r.ext > self.rem_input and self.can_run:
            return "other"
        tree = self.s.tree
        self.rem_total += tree.lock(r.lock)
        try:
            if total > self.rem_total:
                return "no_token"
            if r.ext <= self.rem_chunk:
                self.can_run.append(r)
                tree.lock(r.lock)
                self.take(r.ext, min(r.max_new, CLIP))
            else:
                if self.rem_chunk == 0:
                    return "other"
                r.ext = self.rem_chunk
                self.can_run.append(r)
                self.new_chunked = r
                tree.lock(r.lock)
                self.take(r.ext, 0)
        finally:
            self.rem_total += tree.unlock(r.lock)
        return self.budget_state()

    def add_one_req_ignore_eos(self, r: OReq) -> str:
        def state(q):
            left = q.max_new * (1.0 if q.ignore_eos else self.s.new_token_ratio) - q.out
            return (left, len(q.prompt) + q.out) if left > 0 else None

        if self.states is None:
            self.states = [x for x in map(state, [r, *self.s.running, *self.can_run]) if x]
            self.states.sort(key=lambda x: x[0])
        elif (x := state(r)) is not None:
            i = 0
            for i in range(len(self.states)):
                if x[0] <= self.states[i][0]:
                    break
            self.states.insert(i, x)
        cur = self.cur_rem - len(r.prompt)
        freed = 0
        for i, (left, occupied) in enumerate(self.states):
            steps = self.states[i + 1][0] if i + 1 < len(self.states) else left
            if cur + freed - steps * (len(self.states) - i) <= 0:
                return "no_token"
            freed += occupied
        if r.ext <= self.rem_chunk:
            self.can_run.append(r)
            self.take(r.ext, min(r.max_new, CLIP))
        else:
            if self.rem_chunk == 0:
                return "other"
            r.ext = self.rem_chunk
            self.can_run.append(r)
            self.new_chunked = r
            self.take(r.ext, 0)
        return self.budget_state()


def _lcp(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
