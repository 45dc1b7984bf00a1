"""A router that runs for weeks keeps bounded state: requests through the router core and each policy (no model: each
worker is a block cache of fixed size that stores and evicts, telling the router in KV events), with conversations
that keep starting and ending, a worker flushed every 1/20 of the run and one removed and added back every 1/5.
Every structure the policy counts (``state_sizes``) at the end is at most 1.5x what it was at the half-way mark
(plus a slack of 64 entries): it plateaus instead of growing with the traffic; sessions (sticky_prefix) number at
most the requests of their lifetime (``affinity_ttl_s``) at both marks.

Every router configuration runs 3,000 requests in the default suite; sticky_prefix, which remembers the most,
a million under ``long``."""
from __future__ import annotations

import random
from collections import OrderedDict, deque
from pathlib import Path

import pytest
import yaml

from framework.contracts.routing import FLUSHED, RequestUsage, RequestView
from framework.core.registry import ROUTING
from framework.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from framework.kv_events.hashing import chain_hashes
from framework.routing.core import OK, RouterCore

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = sorted(p.stem for p in (ROOT / "conf" / "router").glob("*.yaml"))
DEFAULT_SET = {"cache_aware", "precise_prefix", "sticky_prefix"}   # the others under -m long
B = 4                    # tokens per block
WORKERS = [f"http://w{i}" for i in range(4)]


class BlockCache:
    """A worker's prefix cache of ``capacity`` blocks, least recently used out first (a block before its parent)."""

    def __init__(self, capacity: int, block: int):
        self.capacity, self.b = capacity, block
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, tokens: list[int]) -> tuple[int, list]:
        """(tokens it had cached, the KV events of serving the prompt)."""
        B = self.b
        hashes = chain_hashes(tokens, B)
        have = 0
        while have < len(hashes) and hashes[have] in self.blocks:
            have += 1
        events = []
        if have < len(hashes):
            events.append(BlockStored(tuple(hashes[have:]), hashes[have - 1] if have else None,
                                      tuple(tokens[have * B:len(hashes) * B]), B))
        for h in reversed(hashes):  # the deepest first: the parent ends up the most recent
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        gone = []
        while len(self.blocks) > self.capacity:
            gone.append(self.blocks.popitem(last=False)[0])
        if gone:
            events.append(BlockRemoved(tuple(gone)))
        return have * B, events


def conversations(rng: random.Random, B: int, live: int = 64, turns: int = 6, systems: int = 8):
    """Endless requests of ``live`` conversations at a time, each of up to ``turns`` turns on one of a few shared
    system prompts; a finished conversation is replaced by a new one. Turns are slices of one random pool (cheap)."""
    pool = [rng.randrange(1, 250) for _ in range(1 << 16)]
    system = [pool[i * 4 * B:(i + 1) * 4 * B] for i in range(systems)]
    open_ = [[system[i % systems], 0] for i in range(live)]
    pick = rng.randrange
    while True:
        c = open_[pick(live)]
        at = pick(len(pool) - 4 * B)
        c[0] = c[0] + pool[at:at + B + at % (2 * B)]
        c[1] += 1
        yield c[0]
        c[0] = c[0] + pool[at + 2 * B:at + 3 * B]  # the answer
        if c[1] == turns:
            c[0], c[1] = system[pick(systems)], 0


def policy_for(router: str, session_ttl_s: float | None, block: int):
    """The policy of conf/router/<router>.yaml (read as it is: composing it through Hydra costs more than the run)."""
    doc = yaml.safe_load((ROOT / "conf" / "router" / f"{router}.yaml").read_text())
    cls = ROUTING.get(doc["name"])
    cfg = cls.Config(**{k: v for k, v in doc.items() if k != "defaults"})
    if hasattr(cfg, "block_size"):
        cfg.block_size = block
    if hasattr(cfg, "max_tree_size"):
        cfg.max_tree_size = 20_000  # characters per worker: reached within the run
    if session_ttl_s is not None and getattr(cfg, "session_affinity", False):
        cfg.affinity_ttl_s = session_ttl_s
    return cls(cfg, 0)


def soak(router: str, requests: int, checkpoints: tuple[int, ...], rate: float, session_ttl_s: float | None = None,
         cache_blocks: int = 2000, block: int = B, in_flight: int = 32) -> dict[int, dict[str, int]]:
    """``state_sizes`` at each checkpoint of ``requests`` sent at ``rate`` per simulated second, in front of workers
    whose caches hold ``cache_blocks`` blocks."""
    now = [0.0]
    core = RouterCore(policy_for(router, session_ttl_s, block), clock=lambda: now[0])
    caches = {w: BlockCache(cache_blocks, block) for w in WORKERS}
    for w in WORKERS:
        core.add_worker(w, healthy=True)
    follows = bool(core.policy.subscriptions)
    flush_every, readd_every = requests // 20, requests // 5
    flying: deque = deque()
    sizes = {}
    source = conversations(random.Random(0), block)
    for i in range(1, requests + 1):
        now[0] = i / rate
        tokens = next(source)
        att = core.dispatch(RequestView(bytes(tokens).decode("latin-1"), tokens))  # text for the text policies
        core.hold_over(att)  # sent at once: a hold (sticky_prefix) is not waited for here
        flying.append((att, tokens))
        if len(flying) > in_flight:
            att, tokens = flying.popleft()
            url = att.worker.url
            if follows and core.is_current(att.worker):
                cached, events = caches[url].serve(tokens)
                core.worker_events(url, events)
                att.usage = RequestUsage(len(tokens), cached, block)
            att.verdict, att.served = OK, True
            core.release(att)
        if i % 1000 == 0:
            core.maintain()
        if i % flush_every == 0:  # a worker flushed (POST /flush_cache)
            w = WORKERS[(i // flush_every) % len(WORKERS)]
            caches[w] = BlockCache(cache_blocks, block)
            if follows:
                core.worker_events(w, [AllBlocksCleared()])
            else:
                core.reset_worker(w, FLUSHED)
        if i % readd_every == 0:  # a worker removed and added back (a restart under the supervisor)
            w = WORKERS[(i // readd_every) % len(WORKERS)]
            core.remove_worker(w)
            caches[w] = BlockCache(cache_blocks, block)
            core.add_worker(w, healthy=True)
        if i in checkpoints:
            sizes[i] = dict(core.policy.state_sizes())
    return sizes


def assert_plateau(sizes: dict[int, dict[str, int]], mid: int, end: int, sessions_bound: float) -> None:
    """Every structure at ``end`` within 1.5x (+64) of ``mid``; sessions within the requests of their lifetime."""
    for name, n in sizes[end].items():
        assert n <= 1.5 * sizes[mid][name] + 64, (name, sizes)
    for at in (mid, end):
        assert sizes[at].get("sessions", 0) <= sessions_bound, sizes


@pytest.mark.parametrize("router", [r if r in DEFAULT_SET else pytest.param(r, marks=pytest.mark.long) for r in ROUTERS])
def test_state_stays_bounded(router):
    """3,000 requests over 600 simulated seconds, sessions remembered for 60 s (past it by the half-way mark),
    caches of 200 blocks (full well before it)."""
    sizes = soak(router, 3_000, (1_500, 3_000), rate=5.0, session_ttl_s=60.0, cache_blocks=200)
    assert_plateau(sizes, 1_500, 3_000, sessions_bound=5.0 * 60.0)


@pytest.mark.long
def test_state_stays_bounded_over_a_million_requests():
    """The same over a million requests (2,000 simulated seconds; about 3 minutes of CPU: the longest of CI's long tests)."""
    sizes = soak("sticky_prefix", 1_000_000, (500_000, 1_000_000), rate=500.0, cache_blocks=500, block=16)
    assert_plateau(sizes, 500_000, 1_000_000, sessions_bound=500.0 * 600.0)
