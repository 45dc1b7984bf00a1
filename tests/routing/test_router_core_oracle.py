"""One router core, two drivers: a scripted trace replayed (a) through the HTTP router service on loopback and (b)
through the simulator's router on a fake clock gives the same decisions (worker, reason, estimate), the same holds
and the same estimates.

The trace is an agent workload: sessions over two shared tool prompts, each step extending its session's prompt,
interleaved so that requests arrive while the prompt they share is still being prefilled on its worker (the policy
holds them until that worker's KV events say it is stored), with a request its worker refuses and a quiet spell that
expires what the view credited to ended requests. Each worker's cache is a real RadixCache on both sides: over HTTP
its events go out through a real ZMQ publisher to the router's subscriber, in the simulation straight to the
simulator's router (as in mode=sim); what a worker reports as cached is what its cache held of the prompt.

Steps run one at a time; after each the HTTP side waits until it has settled (every event batch received, every
request held at the router or arrived at its worker), so both drivers feed the core in the same order. Both
drivers' logs must be equal: any bookkeeping of one that diverges (in-flight counts, holds, credits taken back,
usage, estimates) changes a later decision, a hold or a figure.
"""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from framework.contracts.routing import RequestUsage
from framework.core.registry import ROUTING
from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from framework.kv_events.publisher import ZmqEventPublisher
from framework.load.http_client import parse_route
from framework.serving.http.proxy import ROUTE_HEADER, WORKER_HEADER
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import ROUTER_KEY, create_router_app
from framework.sim.router import SimRouter

pytestmark = pytest.mark.anyio
B = 4  # KV block size, tokens
WORKERS = 3
OUTPUT_TOKENS = 8
TOOLS = ("You are a coding agent. Tools: read(path), write(path, text), run(cmd). Think, then call one tool.\n",
         "You answer questions on a calculator API: add(a, b), mul(a, b), div(a, b). Be brief, show the call.\n")
# sticky_prefix (conf/router/sticky_prefix.yaml) with a hold no step outlasts: holds end by events only
STICKY = dict(block_size=B, cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5,
              miss_policy="least_prefill", prefill_slack=0.25, session_affinity=True, spill_factor=1.5,
              spill_pressure=1.0, hold_s=30.0)
POLICIES = {"sticky_prefix": ("precise_prefix", STICKY), "cache_aware": ("cache_aware", {})}
STEP_S = 0.1  # fake seconds between steps


def agent_prompts() -> dict[str, str]:
    """Four sessions over the two tool prompts and one alone, two steps each: step 1 is step 0's prompt, the agent's
    call and the tool's result; and one more request on the first tool prompt."""
    tasks = ["fix the failing test in test_io.py", "what is 7 * 6?", "add a README for the parser",
             "what is 10 / 4?"]
    prompts = {f"s{s}/0": f"{TOOLS[s % 2]}task {s}: {task}\n" for s, task in enumerate(tasks)}
    prompts["s4/0"] = "You translate English into French, word for word, keeping the punctuation.\nthe cat sat.\n"
    for s in range(5):
        prompts[f"s{s}/1"] = prompts[f"s{s}/0"] + f"call: run(step {s})\nresult: done with {s}; go on\n"
    prompts["big/0"] = TOOLS[0] + "task 5: " + "rewrite everything " * 6 + "\n"
    return prompts


TRACE = [("send", "s0/0"), ("send", "s1/0"), ("send", "s4/0"),
         ("send", "s2/0"),                     # TOOLS[0] is credited to s0/0, not stored yet: held
         ("prefill", "s0/0"),                  # its events store it: s2/0 goes
         ("send", "s3/0"),                     # the same for TOOLS[1] behind s1/0
         ("prefill", "s4/0"), ("prefill", "s1/0"), ("prefill", "s2/0"), ("prefill", "s3/0"),
         ("done", "s0/0"), ("done", "s1/0"), ("done", "s4/0"),
         ("send", "s0/1"),                     # continues s0/0
         ("send", "big/0"), ("refuse", "big/0"),  # refused: its credit is taken back
         ("done", "s2/0"), ("done", "s3/0"),
         ("tick", 3.0), ("maintain",),          # past confirm_s: the credits of ended requests expire
         ("prefill", "s0/1"), ("send", "s2/1"), ("send", "s1/1"), ("send", "s4/1"), ("prefill", "s2/1"),
         ("prefill", "s1/1"), ("done", "s0/1"), ("done", "s2/1"), ("done", "s1/1"), ("prefill", "s4/1"),
         ("done", "s4/1"), ("send", "s3/1"), ("prefill", "s3/1"), ("done", "s3/1")]
FIGURES = ("decisions", "estimated_hit_rate", "matched_chars", "request_chars", "reported_hit_rate",
           "reported_requests", "reasons", "retries", "holds", "per_worker_requests", "policy_accuracy")


def make_policy(name: str):
    key, fields = POLICIES[name]
    cls = ROUTING.get(key)
    return cls(cls.Config(**fields), seed=0)


def new_cache(sink) -> RadixCache:
    cache = RadixCache(lambda slots: None)
    cache.observer = CacheEventEmitter(B, sink)
    return cache


def prefill(cache: RadixCache, text: str) -> int:
    """The worker prefills the prompt: its cache stores it (and publishes the events); returns what it held before."""
    tokens = list(text.encode())
    return cache.insert(tokens, torch.arange(len(tokens)))


class Log:
    """What a driver showed: the decision of each request, the requests held after each step, the figures."""

    def __init__(self):
        self.decisions: dict[str, tuple] = {}
        self.held: list[tuple[int, tuple[str, ...]]] = []
        self.figures: dict = {}

    def step(self, i: int, held) -> None:
        self.held.append((i, tuple(sorted(held))))


# -- (b) the simulator's router --------------------------------------------------------------------------------------
def replay_sim(policy, urls: list[str], prompts: dict[str, str]) -> Log:
    router = SimRouter(policy, urls, maintain_interval_s=3600.0, block_size=B)
    caches = {u: RadixCache(lambda slots: None) for u in urls}
    for url, cache in caches.items():
        router.watch(url, [cache])  # the simulated worker's cache events reach the router as in mode=sim
    log, attempts, held, cached, now = Log(), {}, set(), {}, 0.0
    router.on_release = lambda released: held.difference_update(a.ref for a in released)
    for i, (what, *arg) in enumerate(TRACE):
        now += arg[0] if what == "tick" else STEP_S
        rid = arg[0] if arg else None
        if what == "send":
            text = prompts[rid]
            att, hold = router.send(text, list(text.encode()), now)
            att.ref, attempts[rid] = rid, att
            if hold > 0:
                held.add(rid)
        elif what == "prefill":
            assert rid not in held, f"{rid} is still held at the router"
            cached[rid] = prefill(caches[attempts[rid].worker.url], prompts[rid])
        elif what in ("done", "refuse"):
            att = attempts[rid]
            d = att.decision
            log.decisions[rid] = (att.worker.url, d.reason, d.matched_chars, d.request_chars)
            usage = RequestUsage(len(prompts[rid].encode()), cached.get(rid, 0), OUTPUT_TOKENS)
            router.done(att, now, ok=what == "done", usage=usage)
        elif what == "maintain":
            router.maintain(now)
        log.step(i, held)
    stats = router.stats()
    log.figures = {k: stats.get(k) for k in FIGURES}
    assert all(w["in_flight"] == 0 for w in stats["workers"])
    return log


# -- (a) the HTTP router service -----------------------------------------------------------------------------------
class StubWorker:
    """A worker whose cache is a RadixCache publishing its KV events over ZMQ, and which answers /generate with its
    usage when the test says so (``finish``)."""

    def __init__(self):
        self.publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.published = 0
        self.cache = new_cache(self._publish)
        self.waiting: dict[str, asyncio.Future] = {}  # rid -> (status, usage) to answer with
        self.cached: dict[str, int] = {}
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/get_server_info", self.server_info)

    def _publish(self, event) -> None:
        self.published += 1
        self.publisher.publish(event)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"kv_events": self.publisher.info})  # where the router subscribes

    async def generate(self, request: web.Request) -> web.Response:
        rid = request.headers["X-Request-Id"]
        self.waiting[rid] = asyncio.get_running_loop().create_future()
        status, prompt = await self.waiting[rid]
        if status != 200:
            return web.json_response({"error": {"message": "prompt too long"}}, status=status)
        meta = {"prompt_tokens": prompt, "cached_tokens": self.cached.get(rid, 0),
                "completion_tokens": OUTPUT_TOKENS}
        return web.json_response({"text": "x" * OUTPUT_TOKENS, "meta_info": meta})


async def http_step(step, stubs, router, http, tasks, prompts) -> None:
    what, *arg = step
    rid = arg[0] if arg else None
    if what == "send":
        body = {"text": prompts[rid], "sampling_params": {"max_new_tokens": OUTPUT_TOKENS}}
        tasks[rid] = asyncio.create_task(http.post("/generate", json=body, headers={"X-Request-Id": rid}))
    elif what == "prefill":
        stub = next((s for s in stubs if rid in s.waiting), None)
        assert stub is not None, f"{rid} is still held at the router"
        stub.cached[rid] = prefill(stub.cache, prompts[rid])
    elif what in ("done", "refuse"):
        stub = next(s for s in stubs if rid in s.waiting)
        stub.waiting[rid].set_result((200 if what == "done" else 400, len(prompts[rid].encode())))
    elif what == "maintain":
        router.core.maintain()  # what the service's periodic job calls


async def settled(stubs, router, tasks) -> None:
    """Every event published received; every request in flight held at the router or arrived at a worker."""
    def received() -> int:
        return sum(sub.stats["events"] for sub, _ in router.events.subscribers.values())

    def ready() -> bool:
        arrived = sum(rid in s.waiting for s in stubs for rid, t in tasks.items() if not t.done())
        open_ = sum(not t.done() for t in tasks.values())
        events = not router.events.kv or received() == sum(s.published for s in stubs)
        return events and arrived + len(router.core.held()) == open_
    for _ in range(500):
        if ready():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the HTTP router did not settle")


async def replay_http(policy, stubs, prompts: dict[str, str]) -> Log:
    now = [0.0]
    cfg = RouterServiceConfig(health_check_interval_secs=3600, maintain_interval_secs=3600)
    app = create_router_app(policy, [url_of(s) for s in stubs], cfg, clock=lambda: now[0])
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    router, log, tasks = app[ROUTER_KEY], Log(), {}
    try:
        if router.events.kv:
            await until(lambda: len(router.events.subscribers) == len(stubs), "the router to subscribe")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
            for i, step in enumerate(TRACE):
                now[0] += step[1] if step[0] == "tick" else STEP_S
                await http_step(step, stubs, router, http, tasks, prompts)
                if step[0] in ("done", "refuse"):
                    resp = await tasks[step[1]]
                    await resp.read()
                    reason, estimate = parse_route(resp.headers[ROUTE_HEADER])
                    of = int(resp.headers[ROUTE_HEADER].rsplit("of=", 1)[1])
                    log.decisions[step[1]] = (resp.headers[WORKER_HEADER], reason, estimate, of)
                    assert step[1] in next(s for s in stubs if url_of(s) == resp.headers[WORKER_HEADER]).waiting
                await settled(stubs, router, tasks)
                log.step(i, [r for r, t in tasks.items() if not t.done() and not any(r in s.waiting for s in stubs)])
            stats = await (await http.get("/router_stats")).json()
        log.figures = {k: stats.get(k) for k in FIGURES}
        assert all(w["in_flight"] == 0 for w in stats["workers"])
    finally:
        await server.close()
    return log


def url_of(stub) -> str:
    return f"http://127.0.0.1:{stub.server.port}"


async def until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def stubs():
    workers = [StubWorker() for _ in range(WORKERS)]
    for w in workers:
        w.server = TestServer(w.app, host="127.0.0.1", port=0)
        await w.server.start_server()
    yield workers
    for w in workers:
        await w.server.close()
        w.publisher.close()


@pytest.mark.parametrize("name", POLICIES)
async def test_one_trace_gives_the_same_decisions_holds_and_estimates_through_both_drivers(name, stubs):
    prompts = agent_prompts()
    over_http = await replay_http(make_policy(name), stubs, prompts)
    simulated = replay_sim(make_policy(name), [url_of(s) for s in stubs], prompts)
    assert over_http.decisions == simulated.decisions
    assert over_http.held == simulated.held
    assert over_http.figures == simulated.figures
    # the trace covers what it is meant to: requests on several workers, estimates, and holds (sticky_prefix)
    reasons, figures = {d[1] for d in simulated.decisions.values()}, simulated.figures
    assert len({d[0] for d in simulated.decisions.values()}) >= 2 and figures["matched_chars"] > 0
    if name == "sticky_prefix":
        assert figures["holds"] >= 2 and {"session", "cache_hit", "cache_miss"} <= reasons
        assert len(figures["per_worker_requests"]) == WORKERS
        assert figures["policy_accuracy"]["requests"] == figures["reported_requests"] == len(simulated.decisions) - 1
