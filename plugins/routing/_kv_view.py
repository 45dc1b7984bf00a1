"""The exact view of the workers' caches that the token policies share (precise_prefix, kv_cost): which full blocks
each worker holds, learnt from its KV events (framework/kv_events), plus the blocks of the requests the router sent it
that its events have not confirmed yet.

A block is keyed by ``BlockKeys`` (chained over the block's tokens, so a request's blocks and an event's meet whatever
hash the worker publishes): an event's ``BlockStored`` chains its blocks on the key of its parent block, found through
the worker's own hash of it. A worker holds a block while its count in ``_holders`` is positive: one per event that
stored it, one per request in flight credited with it (``credit`` at the decision, ``debit`` when the request ends --
by then its prefill has been stored and the events say so, or it failed). Pending credits are servelab's addition:
without them two requests with the same new prefix sent a moment apart scatter, since the first one's blocks are not
stored yet when the second is routed.

``RequestBlocks`` is what a policy reads of a request: its tokens (the client's token ids, else the tokenizer's) and
their block keys. Only the byte tokenizer is built in (servelab's: a token per UTF-8 byte); a policy in front of
workers with another tokenizer is given the token ids by its caller (``RequestView.token_ids``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from framework.kv_events.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from framework.kv_events.hashing import ROOT_HASH, BlockKeys
from framework.routing import (KV_EVENTS, USAGE, RequestUsage, RequestView, RoutingConfig, RoutingDecision,
                               RoutingPolicy)

TOKENIZERS = ("byte",)


class KvView:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keys = BlockKeys(block_size)
        self._holders: dict[int, dict[str, int]] = {}  # block key -> {worker: events that stored it + credits}
        self._external: dict[str, dict[BlockHash, int]] = {}  # worker -> its own block hash -> our key
        self._by_events: dict[str, dict[int, int]] = {}  # worker -> our key -> events that stored it (no credits)
        self.stats = {"stored": 0, "removed": 0, "cleared": 0, "orphans": 0, "unknown_removed": 0}

    # -- events ------------------------------------------------------------------------------------------------------
    def apply(self, worker: str, event) -> None:
        if isinstance(event, BlockStored):
            self._stored(worker, event)
        elif isinstance(event, BlockRemoved):
            ext = self._external.get(worker, {})
            for h in event.block_hashes:
                key = ext.pop(h, None)
                if key is None:
                    self.stats["unknown_removed"] += 1
                else:
                    self._unstore(worker, key)
                    self.stats["removed"] += 1
        elif isinstance(event, AllBlocksCleared):
            self.forget(worker)
            self.stats["cleared"] += 1

    def _stored(self, worker: str, e: BlockStored) -> None:
        b = self.block_size
        if e.block_size != b:
            raise ValueError(f"worker {worker} publishes blocks of {e.block_size} tokens; this policy's "
                             f"router.block_size is {b}: set it to the workers' block size")
        if len(e.token_ids) != len(e.block_hashes) * b:
            raise ValueError(f"worker {worker}: a BlockStored of {len(e.block_hashes)} blocks carries "
                             f"{len(e.token_ids)} tokens, not {len(e.block_hashes) * b}")
        ext = self._external.setdefault(worker, {})
        if e.parent_block_hash is None:
            parent = ROOT_HASH
        else:
            parent = ext.get(e.parent_block_hash)
            if parent is None:  # stored on a block the view never saw: unreachable from a request's first block
                self.stats["orphans"] += len(e.block_hashes)
                return
        stored = self._by_events.setdefault(worker, {})
        for h, key in zip(e.block_hashes, self.keys.chain(e.token_ids, parent)):
            if h in ext:
                continue  # stored again without a removal in between: still one copy
            ext[h] = key
            stored[key] = stored.get(key, 0) + 1
            self._add(worker, key)
            self.stats["stored"] += 1

    def forget(self, worker: str) -> None:
        """Drop what the events said of ``worker`` (its pending credits stay with their requests)."""
        for key in self._external.pop(worker, {}).values():
            self._unstore(worker, key)

    def _unstore(self, worker: str, key: int) -> None:
        stored = self._by_events[worker]
        if stored[key] == 1:
            del stored[key]
        else:
            stored[key] -= 1
        self._drop(worker, key)

    def drop_credits(self, worker: str) -> None:
        """Drop every pending credit of ``worker`` (removed: the ends of its requests will not be reported)."""
        for key in [k for k, held in self._holders.items() if worker in held]:
            del self._holders[key][worker]
            if not self._holders[key]:
                del self._holders[key]

    def cached_blocks(self, worker: str) -> int:
        return len(self._by_events.get(worker, ()))

    # -- requests ----------------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], candidates: list[str]) -> dict[str, int]:
        """Per candidate, how many leading blocks of ``keys`` it holds."""
        matched = dict.fromkeys(candidates, 0)
        live = list(candidates)
        holders = self._holders
        depth = 0
        for key in keys:
            held = holders.get(key)
            if held is None:
                break
            if len(held) < len(live) or not all(w in held for w in live):
                live = [w for w in live if w in held]
                if not live:
                    break
            depth += 1
            for w in live:
                matched[w] = depth
        return matched

    def stored_prefix(self, worker: str, keys: Sequence[int], upto: int) -> int:
        """How many of the first ``upto`` of ``keys`` ``worker`` holds by its events alone (pending credits aside)."""
        stored = self._by_events.get(worker, {})
        n = 0
        while n < upto and keys[n] in stored:
            n += 1
        return n

    def credit(self, worker: str, keys: Sequence[int]) -> None:
        for key in keys:
            self._add(worker, key)

    def debit(self, worker: str, keys: Sequence[int]) -> None:
        for key in keys:
            self._drop(worker, key)

    def _add(self, worker: str, key: int) -> None:
        held = self._holders.get(key)
        if held is None:
            self._holders[key] = {worker: 1}
        else:
            held[worker] = held.get(worker, 0) + 1

    def _drop(self, worker: str, key: int) -> None:
        held = self._holders[key]
        n = held[worker] - 1
        if n:
            held[worker] = n
        else:
            del held[worker]
            if not held:
                del self._holders[key]


@dataclass
class KvViewConfig(RoutingConfig):
    """The fields every KV-view policy has (each plugin's Config adds its own)."""
    block_size: int = 16          # tokens per block: the workers' (vLLM's default is 16; servelab's workers take it)
    tokenizer: str = "byte"       # how the router tokenizes a request sent as text (byte: servelab's)
    pending_credit: bool = True   # count a request's blocks on its worker until the request ends (servelab's)


class Credit(NamedTuple):
    """A decision's memo: what the request added to its worker's account until it ends."""
    keys: tuple[int, ...]   # blocks credited to the worker (pending)
    prefill_tokens: int = 0  # tokens it has to prefill there (kv_cost)
    blocks: int = 0          # blocks it occupies there (kv_cost)


class RequestBlocks:
    """A request's tokens and block keys, computed once per decision."""
    __slots__ = ("tokens", "keys")

    def __init__(self, tokens: Sequence[int], keys: list[int]):
        self.tokens, self.keys = tokens, keys


class KvViewPolicy(RoutingPolicy):
    """Base of the policies that route on the exact view: it follows the KV events, tokenizes, credits and debits, and
    keeps its estimates beside what the workers reported (``accuracy``)."""
    subscriptions = frozenset({KV_EVENTS, USAGE})

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        problems = self._check_config(self.cfg)
        if problems:
            raise ValueError(f"router={self.cfg.name}: " + "; ".join(problems))
        self.view = KvView(self.cfg.block_size)
        # over the requests whose usage came back: prompt tokens, the estimate of their cached ones, the reported ones
        self.accuracy = {"requests": 0, "prompt_tokens": 0, "estimated_tokens": 0, "cached_tokens": 0}

    @staticmethod
    def _check_config(cfg: KvViewConfig) -> list[str]:
        problems = []
        if cfg.block_size < 1:
            problems.append(f"block_size={cfg.block_size} must be >= 1")
        if cfg.tokenizer not in TOKENIZERS:
            problems.append(f"tokenizer={cfg.tokenizer!r} is not one of {TOKENIZERS} (give token ids otherwise)")
        return problems

    def blocks(self, request: RequestView) -> RequestBlocks:
        tokens = request.token_ids if request.token_ids is not None else request.text.encode("utf-8")
        return RequestBlocks(tokens, self.view.keys.chain(tokens))

    def estimate(self, matched_blocks: int, n_tokens: int) -> int:
        """Prompt tokens a worker holding ``matched_blocks`` leading blocks serves from cache: SGLang and vLLM compute
        at least the last prompt token."""
        return min(matched_blocks * self.cfg.block_size, max(n_tokens - 1, 0))

    def stored_estimate(self, worker: str, req: RequestBlocks, matched_blocks: int) -> int:
        """The decision's estimate (``matched_chars``): what ``worker``'s events say it holds of the request -- the
        exact view's figure, without the pending credits the decision also counted."""
        return self.estimate(self.view.stored_prefix(worker, req.keys, matched_blocks), len(req.tokens))

    def credit(self, worker: str, req: RequestBlocks, held: int) -> tuple[int, ...]:
        """Credit ``worker`` with the request's blocks past the ``held`` it holds; returns them."""
        if not self.cfg.pending_credit:
            return ()
        keys = tuple(req.keys[held:])
        self.view.credit(worker, keys)
        return keys

    def _observe(self, worker: str, event) -> None:
        self.view.apply(worker, event)

    def _forget(self, worker: str) -> None:
        self.view.forget(worker)

    def _settle(self, decision: RoutingDecision, ok: bool, usage: RequestUsage | None) -> None:
        if decision.memo is not None and decision.memo.keys:
            self.view.debit(decision.worker, decision.memo.keys)
        if ok and usage is not None:
            a = self.accuracy
            a["requests"] += 1
            a["prompt_tokens"] += usage.prompt_tokens
            a["estimated_tokens"] += decision.matched_chars
            a["cached_tokens"] += usage.cached_tokens

    def remove_worker(self, worker: str) -> None:
        super().remove_worker(worker)
        self.view.drop_credits(worker)  # its requests' on_request_done no longer reach the policy
