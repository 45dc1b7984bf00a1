"""The base of the policies that route on the exact view of the workers' caches (_kv_view.py): it follows the KV
events, tokenizes requests, credits a request's blocks to its worker, and keeps its estimates beside what the workers
reported (``accuracy``).

With ``hold_s`` > 0 (servelab's, off by default) a request whose prefix on its worker is only credited to requests in
flight there (no ``BlockStored`` yet: still being prefilled, perhaps in chunks) is held at the router (``hold_s``, the
``RoutingPolicy`` hook the HTTP router and the simulator ask after each batch of that worker's events) until the prefix
is stored or ``hold_s`` passes: sent at once, it would be prefilled beside the other's remaining chunks and hit only
what the finished ones stored, while the view counted all of it.

``RequestBlocks`` is what a policy reads of a request: its tokens (the client's token ids, else the tokenizer's) and
their block keys. Only the byte tokenizer is built in (servelab's: a token per UTF-8 byte); a policy in front of
workers with another tokenizer is given the token ids by its caller (``RequestView.token_ids``).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from framework.contracts.routing import (EVENTS_LOST, KV_EVENTS, USAGE, RequestUsage, RequestView, RoutingConfig,
                                         RoutingDecision, RoutingPolicy)
from framework.kv_events.hashing import BlockKeys
from plugins.routing.lib.kv_view import KvView



class Tokenizer(enum.StrEnum):
    """How the router tokenizes a request sent as text (``router.tokenizer``)."""
    byte = "byte"   # a token per UTF-8 byte: servelab's


TOKENIZERS = tuple(t.value for t in Tokenizer)


@dataclass
class KvViewConfig(RoutingConfig):
    """The fields every KV-view policy has (each plugin's Config adds its own)."""
    block_size: int = 16          # tokens per block: the workers' (vLLM's default is 16; servelab's workers take it)
    tokenizer: Tokenizer = Tokenizer.byte   # how the router tokenizes a request sent as text
    pending_credit: bool = True   # count a request's blocks on its worker before its events say so (servelab's)
    confirm_s: float = 2.0        # ...after it ended, for at most this long
    hold_s: float = 0.0           # > 0: hold a request whose prefix is still being prefilled, this long at most


class Credit(NamedTuple):
    """A decision's memo: what the request added to its worker's account until it ends."""
    keys: tuple[int, ...]    # blocks credited to the worker
    prefill_tokens: int = 0  # tokens it has to prefill there (KvViewPolicy.prefill_tokens)
    blocks: int = 0          # blocks it occupies there (kv_cost)
    confirmed_tokens: int = 0  # the estimate without the credits of requests in flight
    first_block: int | None = None  # the request's first block key, while it counts as in flight (precise_prefix)
    since: int = 0             # the view's removal count at the decision (KvView.retire)
    hold: tuple[int, ...] = ()  # the prefix to see stored before the request is sent (hold_s > 0), ...
    hold_until: float = 0.0     # ...until this time at most


class PromptKeys:
    """A request's block keys, reusing those of a recent prompt it continues: the next turn of a conversation or an
    agent's next step repeats its history, so only the blocks past it are hashed (hashing every block of a long prompt
    was most of a decision's time). The last ``size`` prompts of at least ``min_blocks`` blocks are remembered, at most
    ``per_prefix`` per first block (the ones that share it are compared with the request, newest first, until one is a
    prefix of it: a ``bytes`` test in C); prompts of tokens >= 256 are hashed whole."""

    def __init__(self, keys: BlockKeys, size: int = 1024, per_prefix: int = 64, min_blocks: int = 16):
        self.chain, self.b = keys.chain, keys.block_size
        self.size, self.per_prefix, self.min_blocks = size, per_prefix, min_blocks
        self._by_first: dict[bytes, deque[tuple[bytes, list[int]]]] = {}  # first block -> recent prompts
        self._order: deque[bytes] = deque()  # the first block of each remembered prompt, oldest first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def keys(self, tokens) -> list[int]:
        b = self.b
        if len(tokens) < self.min_blocks * b:
            return self.chain(tokens)
        try:
            raw = tokens if isinstance(tokens, bytes) else bytes(tokens)
        except ValueError:  # a token of 256 or more
            return self.chain(tokens)
        raw = raw[:len(raw) // b * b]
        first = raw[:b]
        recent = self._by_first.get(first)
        best, best_keys = b"", None
        if recent:
            startswith = raw.startswith
            for prev, keys in reversed(recent):  # the newest it continues (usually the turn before it)
                if startswith(prev):
                    best, best_keys = prev, keys
                    break
        if best_keys is None:
            keys = self.chain(raw)
        elif len(best) == len(raw):
            return best_keys
        else:
            keys = best_keys + self.chain(raw[len(best):], best_keys[-1])
        self._remember(first, raw, keys, recent)
        return keys

    def _remember(self, first: bytes, raw: bytes, keys: list[int], recent) -> None:
        if recent is None:
            recent = self._by_first[first] = deque()
        elif len(recent) >= self.per_prefix:
            recent.popleft()
            self._count -= 1
        recent.append((raw, keys))
        self._order.append(first)
        self._count += 1
        while self._count > self.size:  # the oldest prompt of the oldest first block goes (entries may be gone)
            old = self._order.popleft()
            bucket = self._by_first.get(old)
            if bucket:
                bucket.popleft()
                self._count -= 1
                if not bucket:
                    del self._by_first[old]
        if len(self._order) > 4 * self.size:  # drop the stale names of prompts already gone
            self._order = deque(f for f, q in self._by_first.items() for _ in q)


class RequestBlocks:
    """A request's tokens and block keys, computed once per decision."""
    __slots__ = ("tokens", "keys")

    def __init__(self, tokens: Sequence[int], keys: list[int]):
        self.tokens, self.keys = tokens, keys


class KvViewPolicy(RoutingPolicy):
    subscriptions = frozenset({KV_EVENTS, USAGE})
    keeps_estimate = True

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        problems = self._check_config(self.cfg)
        if problems:
            raise ValueError(f"router={self.cfg.name}: " + "; ".join(problems))
        self.view = KvView(self.cfg.block_size, self.cfg.confirm_s)
        # over the requests whose usage came back: prompt tokens, the estimate of their cached ones (with and without
        # the in-flight credits), and what the workers reported
        self.accuracy = {"requests": 0, "prompt_tokens": 0, "estimated_tokens": 0, "confirmed_tokens": 0,
                         "cached_tokens": 0}
        self.prefill_tokens: dict[str, int] = {}  # worker -> prompt tokens its requests in flight had to prefill
        self.prompts = PromptKeys(self.view.keys)

    @classmethod
    def kv_block_size(cls, cfg: KvViewConfig) -> int:
        return cfg.block_size

    @classmethod
    def ignored_keys(cls, cfg: KvViewConfig) -> dict[str, str]:
        if cfg.pending_credit:
            return {}
        return {"confirm_s": "it bounds how long an ended request's blocks stay credited, and router.pending_credit="
                             "false credits none; set router.pending_credit=true, or drop it"}

    @staticmethod
    def _check_config(cfg: KvViewConfig) -> list[str]:
        problems = []
        if cfg.block_size < 1:
            problems.append(f"block_size={cfg.block_size} must be >= 1")
        if cfg.tokenizer not in TOKENIZERS:
            problems.append(f"tokenizer={cfg.tokenizer!r} is not one of {TOKENIZERS} (give token ids otherwise)")
        if cfg.confirm_s < 0:
            problems.append(f"confirm_s={cfg.confirm_s} must be >= 0")
        if cfg.hold_s < 0:
            problems.append(f"hold_s={cfg.hold_s} must be >= 0")
        return problems

    def blocks(self, request: RequestView) -> RequestBlocks:
        tokens = request.token_ids if request.token_ids is not None else request.text.encode("utf-8")
        return RequestBlocks(tokens, self.prompts.keys(tokens))

    def estimate(self, matched_blocks: int, n_tokens: int) -> int:
        """Prompt tokens a worker holding ``matched_blocks`` leading blocks serves from cache: SGLang and vLLM compute
        at least the last prompt token."""
        return min(matched_blocks * self.cfg.block_size, max(n_tokens - 1, 0))

    def decision(self, worker: str, req: RequestBlocks, matched_blocks: int, reason: str,
                 credit: "Credit") -> RoutingDecision:
        """The decision, with its estimate (``matched_chars``): the prompt tokens ``worker`` will serve from cache by
        the view -- stored, recently ended and in flight: a request queued behind another with its prefix finds that
        prefix prefilled. The memo keeps the estimate without the in-flight credits too (``accuracy``)."""
        n = len(req.tokens)
        stored = self.view.confirmed_prefix(worker, req.keys, matched_blocks)
        if credit.prefill_tokens:
            self.prefill_tokens[worker] = self.prefill_tokens.get(worker, 0) + credit.prefill_tokens
        memo = credit._replace(confirmed_tokens=self.estimate(stored, n), since=self.view.removals)
        if self.cfg.hold_s > 0 and stored < matched_blocks:  # the rest is some request's prefill in flight there
            memo = memo._replace(hold=tuple(req.keys[:matched_blocks]), hold_until=self.clock() + self.cfg.hold_s)
        return RoutingDecision(worker, self.estimate(matched_blocks, n), n, reason, memo=memo)

    def hold_s(self, decision: RoutingDecision) -> float:
        """While the prefix this request was routed for is only being prefilled on its worker (credited to requests in
        flight there, no event yet), until ``hold_until``: sent now, it would be prefilled beside their remaining
        chunks and hit only what their finished chunks stored (SGLang inserts a chunked prefill as it goes)."""
        memo = decision.memo
        if not memo.hold:
            return 0.0
        left = memo.hold_until - self.clock()
        worker, n = decision.worker, len(memo.hold)
        if left <= 0 or self.view.confirmed_prefix(worker, memo.hold, n) == n:
            return 0.0
        if self.view.match(memo.hold, [worker])[worker] < n:
            return 0.0  # nothing there is bringing it any more (the request prefilling it failed): wait for nothing
        return left

    def credit(self, worker: str, req: RequestBlocks, held: int) -> tuple[int, ...]:
        """Credit ``worker`` with the request's blocks past the ``held`` it holds; returns them."""
        if not self.cfg.pending_credit:
            return ()
        keys = tuple(req.keys[held:])
        self.view.credit(worker, keys)
        return keys

    def maintain(self, now: float | None = None) -> None:
        self.view.expire(self.clock() if now is None else now)

    def _observe(self, worker: str, event) -> None:
        self.view.apply(worker, event)

    def _worker_reset(self, worker: str, cause: str) -> None:
        # a lost stream leaves the same cache behind: its capacity estimate stands; a flush or a restart re-learns it
        self.view.forget(worker, capacity=cause != EVENTS_LOST)

    def _worker_removed(self, worker: str) -> None:
        self.view.forget(worker, capacity=True)
        self.view.drop_credits(worker)  # its requests' on_request_done no longer reach the policy
        self.prefill_tokens.pop(worker, None)

    def state_sizes(self) -> dict[str, int]:
        return {**self.view.sizes(), "prefill_workers": len(self.prefill_tokens), "prompt_memo": len(self.prompts)}

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        if decision.memo.prefill_tokens:
            self.prefill_tokens[decision.worker] -= decision.memo.prefill_tokens
        keys = decision.memo.keys
        if keys:
            if ok:
                self.view.retire(decision.worker, keys, self.clock(), decision.memo.since)
            else:
                self.view.debit(decision.worker, keys)
        if ok and usage is not None:
            a = self.accuracy
            a["requests"] += 1
            a["prompt_tokens"] += usage.prompt_tokens
            a["estimated_tokens"] += decision.matched_chars
            a["confirmed_tokens"] += decision.memo.confirmed_tokens
            a["cached_tokens"] += usage.cached_tokens
