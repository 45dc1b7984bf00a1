"""A vLLM or SGLang worker of several DP ranks publishes each rank's KV events on its own ZMQ endpoint, the configured
port (and replay port) offset by the rank (vLLM's and SGLang's ``ZmqEventPublisher.offset_endpoint_port``). The
router (framework/serving/router/events.py) follows every rank's stream and files rank r's events under ``url@r``
(``router.dp_aware``) or under the worker seen whole. Real ZMQ publishers on loopback in vLLM's wire format, a real
router, a stub worker answering only its health check and ``/get_server_info``."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager, contextmanager

import pytest
from aiohttp import web

from framework.contracts.routing import EVENTS_LOST
from framework.core.errors import UserError
from framework.core.ports import free_port_block
from framework.core.registry import ROUTING
from framework.kv_events.events import BlockStored, KVEventBatch
from framework.kv_events.publisher import ZmqEventPublisher
from framework.kv_events.ranks import offset_endpoint, rank_streams
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import start_router
from serving_helpers import serve, url_of, wait_until

pytestmark = pytest.mark.anyio
B = 4
TEXTS = ["alpha: rank zero holds this", "bravo: rank one holds this", "charlie: a second prompt"]


def test_the_offset_convention_of_vllm_and_sglang():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 1) is None
    assert [tuple(s) for s in rank_streams("tcp://h:5557", "tcp://h:5560", 2)] == [
        (0, "tcp://h:5557", "tcp://h:5560"), (1, "tcp://h:5558", "tcp://h:5561")]
    assert [tuple(s) for s in rank_streams("tcp://h:5557", None, 1)] == [(None, "tcp://h:5557", None)]
    with pytest.raises(UserError, match="needs a port"):
        offset_endpoint("tcp://host", 1)
    with pytest.raises(UserError, match="past 65535"):
        offset_endpoint("tcp://h:65535", 1)
    with pytest.raises(UserError, match=">= 1"):
        rank_streams("tcp://h:1", None, 0)


class _Lossy:
    """A PUB socket that loses the next ``drop`` messages on the way (their sequence numbers are spent)."""

    def __init__(self, sock):
        self.sock, self.drop = sock, 0

    def send_multipart(self, frames) -> None:
        if self.drop:
            self.drop -= 1
            return
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close()


class CountingPublisher(ZmqEventPublisher):
    """servelab's publisher (vLLM's protocol and wire format) bound where DP rank ``rank`` of a vLLM worker binds,
    counting the replay requests it serves; ``lose()`` loses its next batch in flight."""

    def __init__(self, rank: int, port: int, replay_port: int, stamp: bool = True, **kw):
        """``stamp=False``: its batches name no rank (SGLang's publisher before it added ``attn_dp_rank``)."""
        self.replays = 0
        super().__init__(offset_endpoint(f"tcp://127.0.0.1:{port}", rank),
                         offset_endpoint(f"tcp://127.0.0.1:{replay_port}", rank),
                         data_parallel_rank=rank if stamp else None, **kw)
        self._pub = _Lossy(self._pub)

    def lose(self) -> None:
        self._pub.drop += 1

    def _serve_replay(self) -> None:
        self.replays += 1
        super()._serve_replay()

    def stored(self, text: str) -> int:
        """Publish one BlockStored batch of ``text``'s whole blocks; its sequence number once sent."""
        tokens = tuple(text.encode())[: len(text) // B * B]
        hashes = tuple(hash((text, i)) for i in range(len(tokens) // B))
        before = self.info["last_seq"]
        self.publish_batch(KVEventBatch(time.time(), (BlockStored(hashes, None, tokens, B),), self.rank))
        deadline = time.monotonic() + 5
        while self.info["last_seq"] == before:
            assert time.monotonic() < deadline, "the publisher did not send"
            time.sleep(0.002)
        return self.info["last_seq"]


def worker_app(info: dict, server_info=None) -> web.Application:
    """A stub worker: its health check and ``/get_server_info`` (``info``, a 404 when empty, or ``server_info``)."""
    async def health(request):
        return web.json_response({"status": "ok"})

    async def answer(request):
        return web.json_response(info) if info else web.json_response({"error": "not found"}, status=404)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/get_server_info", server_info or answer)
    return app


@contextmanager
def publishing(pubs: list):
    """The publishers, closed at the end."""
    try:
        yield pubs
    finally:
        for p in pubs:
            p.close()


@asynccontextmanager
async def routed(info: dict, dp_aware: bool, ranks: int, ports: list, **cfg):
    """A router (precise_prefix) in front of one stub worker whose ``ranks`` DP ranks publish on the router's
    ``kv_events_port`` + rank (``ports``: it and the replay port); yields (router server, worker server, policy)."""
    cls = ROUTING.get("precise_prefix")
    policy = cls(cls.Config(block_size=B, pending_credit=False))
    worker = await serve(worker_app(info))
    try:
        server = await start_router(policy, [url_of(worker)], RouterServiceConfig(
            health_check_interval_secs=0.05, dp_aware=dp_aware, kv_events_port=ports[0],
            kv_events_replay_port=ports[1], **cfg), port=0)
        try:
            await wait_until(lambda: len(server.router.events.subscribers) == ranks, what="a subscriber per DP rank")
            await asyncio.sleep(0.3)                    # the SUB sockets' subscriptions reach the publishers
            yield server, worker, policy
        finally:
            await server.cleanup()
    finally:
        await worker.close()


def held(policy, worker: str, text: str) -> int:
    """Whole blocks of ``text`` the router's view says ``worker`` (a candidate: url@rank with dp_aware) holds."""
    view = policy.view               # (the policy the router wraps under dp_aware: its candidates are url@rank)
    return view.match(view.keys.chain(text.encode()), [worker])[worker]


def full(text: str) -> int:
    return len(text) // B


async def test_each_ranks_events_land_under_its_url_at_rank_and_a_late_rank_replays_alone():
    """SGLang's discovery (/get_server_info: dp_size under DP attention): three ranks, of which rank 2 never
    publishes. Rank 1 published before the router subscribed: its first batch seen is past 0, so the router replays
    it from rank 1's replay socket, and from no other. Rank 1's batches name no rank (an older SGLang): its stream
    says it."""
    port, replay_port = free_port_block("127.0.0.1", 3), free_port_block("127.0.0.1", 3)
    pubs = [CountingPublisher(0, port, replay_port), CountingPublisher(1, port, replay_port, stamp=False)]
    # rank 2: nothing bound, nothing sent
    with publishing(pubs):
        pubs[1].stored(TEXTS[1])
        async with routed({"dp_size": 3, "enable_dp_attention": True}, True, 3, [port, replay_port]) as \
                (server, worker, policy):
            url = url_of(worker)
            pubs[0].stored(TEXTS[0])
            pubs[1].stored(TEXTS[2])
            at = [f"{url}@{r}" for r in range(3)]
            await wait_until(lambda: held(policy, at[1], TEXTS[2]) > 0, what="rank 1's second batch")
            await wait_until(lambda: held(policy, at[0], TEXTS[0]) > 0, what="rank 0's batch")
            assert [held(policy, w, TEXTS[0]) for w in at] == [full(TEXTS[0]), 0, 0]
            assert [held(policy, w, TEXTS[1]) for w in at] == [0, full(TEXTS[1]), 0]   # the replayed batch
            assert [held(policy, w, TEXTS[2]) for w in at] == [0, full(TEXTS[2]), 0]
            assert [p.replays for p in pubs] == [0, 1]
            stats = server.router.events.stats()
            assert set(stats) == set(at) and stats[at[1]]["replayed"] == 1 and stats[at[0]].get("replayed", 0) == 0
            assert stats[at[2]]["last_seq"] is None and stats[at[2]]["endpoint"] == f"tcp://127.0.0.1:{port + 2}"


@pytest.mark.parametrize("dp_aware", [True, False])
async def test_a_rank_whose_batches_are_lost_is_reset_alone(dp_aware):
    """vLLM's case (no /get_server_info: router.kv_events_dp_size says the ranks). Rank 1 keeps one batch for replay
    and loses one in flight: the router cannot replay it, so rank 1's view starts over (with dp_aware: a reset of
    url@1 alone; without: its blocks leave the worker's union, except those rank 0 holds too); rank 0's is kept."""
    port, replay_port = free_port_block("127.0.0.1", 2), free_port_block("127.0.0.1", 2)
    pubs = [CountingPublisher(0, port, replay_port), CountingPublisher(1, port, replay_port, buffer_steps=1)]
    shared, own, lost, after = TEXTS[0], TEXTS[1], TEXTS[2], "delta: after the loss"
    with publishing(pubs):
        async with routed({}, dp_aware, 2, [port, replay_port], kv_events_dp_size=2) as (server, worker, policy):
            url = url_of(worker)
            w0, w1 = (f"{url}@0", f"{url}@1") if dp_aware else (url, url)
            resets = []
            reset = policy.reset_worker
            policy.reset_worker = lambda w, cause: (resets.append((w, cause)), reset(w, cause))[1]
            pubs[0].stored(shared)
            pubs[1].stored(shared)
            pubs[1].stored(own)
            await wait_until(lambda: held(policy, w1, own) > 0 and held(policy, w0, shared) > 0,
                             what="both ranks' batches")
            pubs[1].lose()
            pubs[1].stored(lost)          # lost in flight, and gone from the replay buffer by the next one
            pubs[1].stored(after)
            await wait_until(lambda: held(policy, w1, after) > 0, what="rank 1's batch after the loss")
            assert held(policy, w1, lost) == held(policy, w1, own) == 0    # rank 1's view started over
            assert held(policy, w0, shared) == full(shared)                 # rank 0's kept
            assert held(policy, w1, shared) == (0 if dp_aware else full(shared))
            assert pubs[1].replays == 1 and pubs[0].replays == 0
            stats = server.router.events.stats()
            assert [stats[f"{url}@{r}"].get("resyncs", 0) for r in range(2)] == [0, 1]
            assert resets == ([(w1, EVENTS_LOST)] if dp_aware else [])   # whole: its blocks left the union instead


async def test_sglang_without_dp_attention_publishes_on_one_port():
    """SGLang's schedulers publish on port + attn_dp_rank, which is 0 for all of them without DP attention: a
    worker whose /get_server_info says dp_size 2 but enable_dp_attention false is one stream on the base port."""
    cls = ROUTING.get("precise_prefix")
    worker = await serve(worker_app({"dp_size": 2, "enable_dp_attention": False}))
    port = free_port_block("127.0.0.1", 1)
    server = await start_router(cls(cls.Config(block_size=B)), [url_of(worker)], RouterServiceConfig(
        health_check_interval_secs=0.05, kv_events_port=port), port=0)
    try:
        await wait_until(lambda: server.router.events.streams, what="the router to subscribe")
        assert {n: s["endpoint"] for n, s in server.router.events.stats().items()} == {
            url_of(worker): f"tcp://127.0.0.1:{port}"}
    finally:
        await server.cleanup()
        await worker.close()


async def test_a_worker_that_does_not_answer_server_info_at_first_is_asked_again():
    """A /get_server_info that gets no answer (here: timed out) settles nothing: the next passed health check asks
    again, and the worker's dp_size then opens a stream per rank (before, the router settled on one stream)."""
    slow = {"left": 1}

    async def server_info(request):
        if slow["left"]:
            slow["left"] -= 1
            await asyncio.sleep(2.0)                          # past the router's timeout for it
        return web.json_response({"dp_size": 2, "enable_dp_attention": True})

    cls = ROUTING.get("precise_prefix")
    worker = await serve(worker_app({}, server_info))
    port = free_port_block("127.0.0.1", 2)
    server = await start_router(cls(cls.Config(block_size=B)), [url_of(worker)], RouterServiceConfig(
        health_check_interval_secs=0.05, health_check_timeout_secs=0.1, kv_events_port=port), port=0)
    try:
        await wait_until(lambda: len(server.router.events.subscribers) == 2, timeout=5.0,
                         what="a subscriber per rank once /get_server_info answers")
        assert slow["left"] == 0
        assert sorted(s["endpoint"] for s in server.router.events.stats().values()) == [
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    finally:
        await server.cleanup()
        await worker.close()
