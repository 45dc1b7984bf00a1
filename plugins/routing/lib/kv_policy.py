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
from framework.kv_events.hashing import ROOT_HASH, BlockKeys
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
    keys: Sequence[int]      # blocks credited to the worker (a slice of the request's keys)
    prefill_tokens: int = 0  # tokens it has to prefill there (KvViewPolicy.prefill_tokens)
    blocks: int = 0          # blocks it occupies there (kv_cost)
    confirmed_tokens: int = 0  # the estimate without the credits of requests in flight
    first_block: int | None = None  # the request's first block key, while it counts as in flight (precise_prefix)
    since: int = 0             # the view's removal count at the decision (KvView.retire)
    hold: Sequence[int] = ()    # the prefix to see stored before the request is sent (hold_s > 0; a copy), ...
    hold_until: float = 0.0     # ...until this time at most
    parent: int = ROOT_HASH    # the key of the block under the credited ones (``keys``), ...
    depth: int = 0             # ...and the first credited block's depth: the blocks its worker held already


class PromptKeys:
    """A request's block keys, reusing those of a recent prompt it continues: the next turn of a conversation or an
    agent's next step repeats its history, so only the blocks past it are hashed (hashing every block of a long prompt
    was most of a decision's time). The last ``size`` prompts of at least ``min_blocks`` blocks that no later one
    continued are remembered (a prompt continued gives its place to the one that continues it), filed
    by an anchor: for a prompt of n blocks, d the largest power of two <= n, its block d (past a shared system prompt
    as soon as the prompt is twice as long, so a conversation's turns share few anchors with other conversations), at
    most ``per_anchor`` per anchor. A request looks up its own block d at each power of two from its largest down, and
    compares the prompts filed there with itself, newest first, until one is a prefix of it (a ``bytes`` test in C,
    on the prompt's last block first, which tells most others apart without reading them). Any remembered prefix
    gives the same keys: the lookup decides only how many blocks are hashed. Prompts of tokens >= 256 are hashed
    whole. The list ``keys`` returns may be the memo's own (a continuation extends it): read it before the next call.
    Beside each remembered prompt, the policy may leave its match per worker (``note``): the next turn's ``hints``,
    where each worker's search starts (its answer then is most often its answer now). It serves the Python keys: with
    the C ones (``BlockKeys.native``) a policy hashes every prompt whole (``KvViewPolicy.prompts`` is None), which costs
    less than the memo's lookup and update (~2 us for 125 blocks against ~5), and the C search needs no hints."""

    def __init__(self, keys: BlockKeys, size: int = 256, per_anchor: int = 64, min_blocks: int = 16):
        if min_blocks < 1:
            raise ValueError(f"min_blocks={min_blocks} must be >= 1")
        self.chain, self.b = keys.chain, keys.block_size
        self.size, self.per_anchor, self.min_blocks = size, per_anchor, min_blocks
        self._lowest = 1 << (min_blocks.bit_length() - 1)  # the smallest anchor depth a remembered prompt has
        # -> recent prompts, each [prompt, its last block, its keys, its match per worker (``note``) or None]
        self._by_anchor: dict[tuple[int, bytes], deque[list]] = {}
        self._order: deque[tuple[int, bytes]] = deque()  # the anchor of each remembered prompt, oldest first
        self._count = 0
        self.continued = 0  # blocks the last ``keys`` took from the prompt it continues (a hint for ``KvView.match``)
        self.hints: dict[str, int] | None = None  # the match ``note``d for the prompt the last ``keys`` continued
        self._last: list | None = None  # the last ``keys``' prompt's entry, when remembered

    def __len__(self) -> int:
        return self._count

    def noted(self) -> int:
        """Remembered prompts with a match noted (``note``)."""
        return sum(entry[3] is not None for filed in self._by_anchor.values() for entry in filed)

    def keys(self, tokens) -> list[int]:
        b = self.b
        self.continued, self.hints, self._last = 0, None, None
        if len(tokens) < self.min_blocks * b:
            return self.chain(tokens)
        try:
            raw = tokens if isinstance(tokens, bytes) else bytes(tokens)
        except ValueError:  # a token of 256 or more
            return self.chain(tokens)
        n = len(raw) // b
        raw = raw[:n * b]
        depth = top = 1 << (n.bit_length() - 1)
        best, best_keys, found = b"", None, None
        startswith, by_anchor = raw.startswith, self._by_anchor
        while best_keys is None and depth >= self._lowest:
            anchor = (depth, raw[(depth - 1) * b:depth * b])
            filed = by_anchor.get(anchor)
            if filed:
                for entry in reversed(filed):  # the newest it continues (usually the turn before it)
                    prev, tail, keys, _ = entry
                    if startswith(tail, len(prev) - b) and startswith(prev):
                        best, best_keys, found = prev, keys, (anchor, entry)
                        break
            depth >>= 1
        if best_keys is None:
            keys = self.chain(raw)
        elif len(best) == len(raw):
            entry = found[1]
            self.continued, self.hints, self._last = len(best_keys), entry[3], entry
            return best_keys
        else:
            anchor, entry = found
            self.continued, self.hints = len(best_keys), entry[3]
            # continued: this prompt takes its place (a prompt is continued once, as a rule), and its list, extended in
            # place: a copy would touch every key of the prompt, not only the new ones
            keys = best_keys
            keys += self.chain(raw[len(best):], best_keys[-1])
            filed = by_anchor[anchor]
            filed.remove(entry)
            self._count -= 1
            if not filed:
                del by_anchor[anchor]
        self._last = self._remember((top, raw[(top - 1) * b:top * b]), raw, keys)
        return keys

    def note(self, matched: dict[str, int]) -> None:
        """Leave the last ``keys``' match per worker with its prompt, for the turn that continues it (``hints``)."""
        if self._last is not None:
            self._last[3] = matched  # kept in the prompt's entry: no dictionary keyed by a whole prompt to hash

    def _remember(self, anchor: tuple[int, bytes], raw: bytes, keys: list[int]) -> list | None:
        """File the prompt; its entry, or None if the memo's bound dropped it at once (a memo of one prompt and a
        stale anchor)."""
        filed = self._by_anchor.get(anchor)
        if filed is None:
            filed = self._by_anchor[anchor] = deque()
        elif len(filed) >= self.per_anchor:
            filed.popleft()
            self._count -= 1
        entry = [raw, raw[-self.b:], keys, None]
        filed.append(entry)
        self._order.append(anchor)
        self._count += 1
        while self._count > self.size:  # the oldest prompt of the oldest anchor goes (entries may be gone)
            old = self._order.popleft()
            filed = self._by_anchor.get(old)
            if filed:
                filed.popleft()
                self._count -= 1
                if not filed:
                    del self._by_anchor[old]
        if len(self._order) > 4 * self.size:  # drop the stale names of prompts already gone
            self._order = deque(a for a, q in self._by_anchor.items() for _ in q)
        filed = self._by_anchor.get(anchor)
        return entry if filed and filed[-1] is entry else None


class RequestBlocks:
    """A request's tokens and block keys, computed once per decision; ``continued``: how many of them are those of a
    recent prompt it continues (the worker that prompt went to likely holds that many: ``KvView.match``'s hint);
    ``hints``: that prompt's match per worker, when noted (``PromptKeys.note``)."""
    __slots__ = ("tokens", "keys", "continued", "hints")

    def __init__(self, tokens: Sequence[int], keys: list[int], continued: int = 0,
                 hints: dict[str, int] | None = None):
        self.tokens, self.keys, self.continued, self.hints = tokens, keys, continued, hints


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
        self.prompts = None if self.view.keys.native else PromptKeys(self.view.keys)  # (PromptKeys: why)

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
        prompts = self.prompts
        if prompts is None:  # the C keys: hashed whole, no hints
            return RequestBlocks(tokens, self.view.keys.chain(tokens))
        keys = prompts.keys(tokens)
        return RequestBlocks(tokens, keys, prompts.continued, prompts.hints)

    def match(self, req: RequestBlocks, candidates: list[str]) -> dict[str, int]:
        """Per candidate, the leading blocks of the request it holds (``KvView.match``, hinted by the prompt it
        continues), noted for the request that will continue it."""
        matched = self.view.match(req.keys, candidates, req.continued, req.hints)
        if self.prompts is not None:
            self.prompts.note(matched)
        return matched

    def estimate(self, matched_blocks: int, n_tokens: int) -> int:
        """Prompt tokens a worker holding ``matched_blocks`` leading blocks serves from cache: SGLang and vLLM compute
        at least the last prompt token."""
        return min(matched_blocks * self.cfg.block_size, max(n_tokens - 1, 0))

    def decision(self, worker: str, req: RequestBlocks, matched_blocks: int, reason: str, keys: Sequence[int],
                 prefill_tokens: int = 0, blocks: int = 0, first_block: int | None = None) -> RoutingDecision:
        """The decision, with its estimate (``matched_chars``): the prompt tokens ``worker`` will serve from cache by
        the view -- stored, recently ended and in flight: a request queued behind another with its prefix finds that
        prefix prefilled. Its memo (``Credit``: the credited ``keys`` and the rest) keeps the estimate without the
        in-flight credits too (``accuracy``); ``keys`` are ``credit``'s, from ``matched_blocks`` on."""
        n = len(req.tokens)
        view = self.view
        stored = view.confirmed_prefix(worker, req.keys, matched_blocks)
        if prefill_tokens:
            self.prefill_tokens[worker] = self.prefill_tokens.get(worker, 0) + prefill_tokens
        hold, hold_until = (), 0.0
        if self.cfg.hold_s > 0 and stored < matched_blocks:  # the rest is some request's prefill in flight there
            hold, hold_until = req.keys[:matched_blocks], self.clock() + self.cfg.hold_s
        b, top = self.cfg.block_size, max(n - 1, 0)  # ``estimate``, inlined (a call each shows in a decision's time)
        memo = Credit(keys, prefill_tokens, blocks, min(stored * b, top), first_block, view.removals, hold, hold_until,
                      req.keys[matched_blocks - 1] if matched_blocks else ROOT_HASH, matched_blocks)
        return RoutingDecision(worker, min(matched_blocks * b, top), n, reason, "", 0.0, memo)

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

    def credit(self, worker: str, req: RequestBlocks, held: int) -> Sequence[int]:
        """Credit ``worker`` with the request's blocks past the ``held`` it holds; returns them (a copy: the memo's
        list may grow in place)."""
        if not self.cfg.pending_credit:
            return ()
        keys = req.keys[held:]
        self.view.credit(worker, keys, req.keys[held - 1] if held else ROOT_HASH, held)
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
        return {**self.view.sizes(), "prefill_workers": len(self.prefill_tokens), "prompt_memo": len(self.prompts or ()),
                "prompt_hints": self.prompts.noted() if self.prompts is not None else 0}

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        if decision.memo.prefill_tokens:
            self.prefill_tokens[decision.worker] -= decision.memo.prefill_tokens
        keys = decision.memo.keys
        if keys:
            memo = decision.memo
            if ok:
                self.view.retire(decision.worker, keys, memo.parent, memo.depth, self.clock(), memo.since)
            else:
                self.view.debit(decision.worker, keys, memo.parent, memo.depth)
        if ok and usage is not None:
            a = self.accuracy
            a["requests"] += 1
            a["prompt_tokens"] += usage.prompt_tokens
            a["estimated_tokens"] += decision.matched_chars
            a["confirmed_tokens"] += decision.memo.confirmed_tokens
            a["cached_tokens"] += usage.cached_tokens
