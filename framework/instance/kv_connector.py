"""A rank's KV connector for prefill/decode disaggregation (the shape of vLLM's KV connector: register the KV
buffers, then send or receive a request's KV, per request or per layer), pairing the two sides by SGLang's bootstrap
fields (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).

Every rank registers its KV pool with the transport (framework/dist/kv_transfer: Mooncake's transfer engine, or the
tcp fallback) and the ranks exchange where their pools live. Rank 0 holds the control plane (ZMQ, msgpack):

- decode: once a request has its slots (framework/engine/disagg.py), rank 0 sends the prefill instance's bootstrap
  address (`bootstrap_host:bootstrap_port`) a *want*: the room, where every decode rank's pool is, the slots, and
  where to answer. The prefill side answers *done* (with its sampled first token, the bytes and seconds) once the
  KV has landed, or *failed*.
- prefill: rank 0 listens on the bootstrap port. In SGLang's order (`engine.disaggregation_order=sglang`, the
  default) a paired request waits, holding no KV, until its room's want has come (`KVBootstrapped` then queues it
  for its prefill), so held KV always has a destination; in DistServe's (`distserve`) it is prefilled at once and
  its KV held until the want comes, which can deadlock (held KV filling this pool, the decode side's slots taken by
  requests waiting here) until the timeout fails the requests. When a paired request's prefill is done and its
  room's want has come, a sender thread writes the KV (read from this rank's pool: every rank of a DP group holds
  the whole MLA latent) straight into every decode rank's pool, then answers.

What a rank must do about it reaches every rank as a command in the step's exchange (`KVBootstrapped`, `KVDone`,
`KVFailed`), so the ranks free and admit in lockstep. Faults: a room unanswered for `disaggregation_timeout_s` fails
on either side (a prefill request that comes after its room's want timed out fails at once: the decode half
is gone); a client that leaves sends the other side a *cancel*; a prefill request that leaves or fails before
its KV is sent (parked, queued or mid-prefill) ends its room at once: the room's want is answered *failed* now, or
when it comes; a decode request's slots are freed only once the prefill side can no longer write them (it answered,
or the timeout passed). Several DP groups (DP attention): on
the decode side a group's leader reports its allocations to rank 0 (KVAllocated, in the exchange) and the KV goes to
that group's ranks; on the prefill side they are not built yet (refused).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

from framework.dist.kv_transfer import TransferError, open_transport, resolve_backend
from framework.engine.config import Role
from framework.engine.disagg import Destination, Pairing

log = logging.getLogger(__name__)
POLL_S = 0.002          # how often an otherwise idle rank 0 looks for transfer news while any is pending
IDLE_POLL_S = 0.02      # ... and while none is (a want or a cancel may come for a room it has not seen yet)


@dataclass(frozen=True)
class KVDone:
    """Decode: the request's KV and first token landed. Prefill: its KV was sent (release it, answer)."""
    rid: str
    token: int = 0
    cached_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class KVBootstrapped:
    """Prefill, SGLang's order: the request's room has its destination; it may be prefilled now."""
    rid: str


@dataclass(frozen=True)
class KVFailed:
    rid: str
    error: str


@dataclass(frozen=True)
class KVAllocated:
    """Decode under DP attention: a DP group's leader (not rank 0) pre-allocated a request's slots; it tells rank 0
    (in the step's exchange), which asks the prefill side for the KV."""
    dest: Destination
    pairing: Pairing
    group: int


@dataclass(frozen=True)
class PoolLayout:
    """Where one rank's KV pool lives: buffer [layer, slot, width] at `base` in the process reached at `endpoint`."""
    endpoint: str
    base: int
    layer_stride: int
    slot_bytes: int
    layers: int

    def addr(self, layer: int, slot: int) -> int:
        return self.base + layer * self.layer_stride + slot * self.slot_bytes


def _pack(msg: dict) -> bytes:
    return msgpack.packb(msg)


class _Pushers:
    """PUSH sockets by address, for one thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, ctx: zmq.Context):
        self.ctx, self.socks = ctx, {}

    def send(self, addr: str, msg: dict) -> None:
        sock = self.socks.get(addr)
        if sock is None:
            sock = self.socks[addr] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(addr)
        try:
            sock.send(_pack(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kv connector: %s does not take messages; dropped %s", addr, msg.get("op"))

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)


class KVConnector:
    def __init__(self, engine, control):
        cfg, par = engine.cfg, engine.par
        if type(par).dp_size(par.cfg) > 1 and cfg.role == Role.prefill:
            raise ValueError(f"engine.role=prefill with {par.cfg.name} ({type(par).dp_size(par.cfg)} DP groups) is "
                             f"not built yet: serve the prefill role with parallel=single or tp (decode: any)")
        # the DP group of every rank: a decode request's KV goes to every rank of the group that holds it
        self.rank_groups = [type(par).dp_rank_of(par.cfg, r) for r in range(par.size)]
        self.leads = par.leads
        buf = engine.pool.buffer
        if buf.device.type != "cpu":
            raise ValueError(f"engine.role={cfg.role} on {buf.device}: the KV transports built here (mooncake's CPU "
                             f"build, tcp) move host memory; a GPU pool needs a GPU transport (Mooncake's CUDA build "
                             f"or NIXL, registered with framework.dist.kv_transfer.register_transport): not built yet")
        self.role, self.rank, self.engine = Role(cfg.role), control.rank, engine
        self.disagg = engine.scheduler.disagg
        self.timeout_s, self.layerwise = cfg.disaggregation_timeout_s, cfg.disaggregation_layerwise
        # SGLang's order: a paired prefill request is parked until its room's destination comes (rank loop: park)
        self.waits_for_destination = self.role is Role.prefill and cfg.disaggregation_order == "sglang"
        self.backend = resolve_backend(cfg.disaggregation_transfer_backend)
        self.transport = open_transport(self.backend, cfg.disaggregation_host)
        esz = buf.element_size()
        self.transport.register(buf.data_ptr(), buf.numel() * esz)
        self.layout = PoolLayout(self.transport.endpoint, buf.data_ptr(), buf.stride(0) * esz, buf.stride(1) * esz,
                                 buf.shape[0])
        self.layouts: list[PoolLayout] = control.all_gather_object(self.layout)
        self.stats_ = {"kv_transfers": 0, "kv_transfer_bytes": 0, "kv_transfer_s": 0.0, "kv_transfer_failures": 0}
        self.bootstrap_port = cfg.disaggregation_bootstrap_port
        if self.rank != 0:
            return
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        host = cfg.disaggregation_host
        if self.role is Role.prefill:
            try:
                self.inbox.bind(f"tcp://{host}:{self.bootstrap_port}")
            except zmq.ZMQError as e:
                raise ValueError(f"engine.disaggregation_bootstrap_port={self.bootstrap_port} on {host}: {e}; "
                                 f"choose a free port") from None
            self.address = f"tcp://{host}:{self.bootstrap_port}"
        else:
            self.address = f"tcp://{host}:{self.inbox.bind_to_random_port(f'tcp://{host}')}"
        self.push = _Pushers(self.ctx)
        self.commands: list = []
        # prefill
        self.wants: dict[int, tuple[dict, float]] = {}     # room -> (want, when it came)
        self.held: dict[str, tuple[int, float]] = {}       # rid -> (room, since when its KV is ready)
        self.parked: dict[str, float] = {}                 # rid -> since when it waits for its room's want
        self.bound: set[int] = set()                       # rooms whose want let their request in (SGLang's order)
        self.inflight: dict[str, int] = {}                 # rid -> room, with the sender thread
        self.cancelled: dict[int, float] = {}              # rooms the decode side gave up (when)
        self.expired: dict[int, tuple[float, str, bool]] = {}  # rooms whose want timed out (when, why, bound then)
        self.dropped: dict[int, tuple[float, str]] = {}    # rooms this side failed before their want came (when, why)
        self.closing: set[str] = set()                     # rids with a command on its way to every rank
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        # decode
        self.asked: dict[str, tuple[int, str, float]] = {}  # rid -> (room, prefill bootstrap address, since when)
        self.by_room: dict[int, str] = {}
        self._elsewhere: list[KVAllocated] = []             # other DP groups' allocations, to ask for
        self._aborted: dict[str, float] = {}                # aborted before rank 0 asked for them (when)
        if self.role is Role.prefill:
            threading.Thread(target=self._send_loop, name="kv-sender", daemon=True).start()

    # -- what the rank loop asks ------------------------------------------------------------------------------
    def busy(self) -> bool:
        if self.disagg.pending():
            return True
        return self.rank == 0 and bool(self.wants or self.inflight or self.asked)

    def stats(self) -> dict:
        info = {"role": self.role.value, "kv_transfer_backend": self.backend, **self.stats_,
                **self.disagg.stats()}
        if self.role is Role.prefill:
            info["disaggregation_bootstrap_port"] = self.bootstrap_port
        else:   # what a P/D router's decider may send it: a request without a pairing, prefilled here
            info["disaggregation_local_prefill"] = self.engine.cfg.disaggregation_local_prefill
        return info

    def poll(self) -> list:
        """Rank 0: this step's commands for every rank (KVDone, KVFailed) from the transfer news. Another rank: the
        KVAllocated events its DP group's allocations owe rank 0 (a decode group's leader), else none."""
        if self.rank != 0:
            dests = self.disagg.take_allocated()
            if not self.leads:
                return []
            group = self.rank_groups[self.rank]
            return [KVAllocated(d, self.disagg.receiving[d.rid].pairing, group) for d in dests]
        now = time.monotonic()
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                (self._on_prefill_msg if self.role is Role.prefill else self._on_decode_msg)(msgpack.unpackb(raw), now)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:   # not a peer's message
                log.warning("kv connector: dropped a malformed control message (%s: %s)", type(e).__name__, e)
        if self.role is Role.prefill:
            self._prefill_poll(now)
        else:
            self._decode_poll(now)
        out, self.commands = self.commands, []
        return out

    def abort(self, rid: str) -> None:
        """Rank 0: the request's client left (its Abort reaches the scheduler in this step's commands, after this)."""
        if self.rank != 0:
            return
        if self.role is Role.prefill:
            if rid in self.disagg.bootstrapping and rid not in self.closing:   # its Abort drops it: no KV held
                self._fail_prefill(rid, self.disagg.bootstrapping[rid].pairing.room, "the prefill request was aborted")
            elif rid in self.inflight:
                self.cancelled[self.inflight[rid]] = time.monotonic()   # the sender thread stops before writing
            elif rid in self.disagg.sending and rid not in self.closing:
                self.held.pop(rid, None)
                self._fail_prefill(rid, self.disagg.sending[rid].pairing.room, "the prefill request was aborted")
            elif rid in self.disagg.prefilling:  # in the scheduler (its Abort drops it): the room ends now, so the
                self._fail_room(self.disagg.prefilling[rid].pairing.room,   # decode side frees its slots at once
                                "the prefill request was aborted before its prefill finished")
        elif rid in self.asked:
            room, bootstrap, _ = self.asked[rid]
            self.push.send(bootstrap, {"op": "cancel", "room": room, "notify": self.address})
        else:                                 # (maybe another DP group's, allocated but not reported yet)
            self._aborted[rid] = time.monotonic()

    def close(self) -> None:
        if self.rank == 0:
            self.jobs.put(None)
            self.push.close()
            self.inbox.close(0)
            self.ctx.term()
        self.transport.close()

    # -- prefill --------------------------------------------------------------------------------------------
    def _on_prefill_msg(self, msg: dict, now: float) -> None:
        room = msg["room"]
        if msg["op"] == "want":
            if (dropped := self.dropped.pop(room, None)) is not None:   # its request failed or left here already
                self.push.send(msg["notify"], {"op": "failed", "room": room,
                                               "error": f"the prefill side gave up room {room}: {dropped[1]}"})
                return
            self.expired.pop(room, None)
            self.wants[room] = (msg, now)
        elif msg["op"] == "cancel":       # answered unless the sender thread has the room (it answers then)
            self.wants.pop(room, None)
            self.bound.discard(room)
            self.cancelled[room] = now
            for rid, (r, _) in list(self.held.items()):
                if r == room:
                    del self.held[rid]
                    self._command(KVFailed(rid, "the decode side cancelled the room"))
            if room not in self.inflight.values():
                self.push.send(msg["notify"], {"op": "failed", "room": room, "error": "cancelled"})

    def _prefill_poll(self, now: float) -> None:
        self.closing &= set(self.disagg.sending) | set(self.disagg.bootstrapping)   # last step's commands applied
        self._admit_parked(now)
        for rid, req in self.disagg.sending.items():
            if rid in self.held or rid in self.inflight or rid in self.closing:
                continue
            if (why := self._room_gone(req.pairing.room)) is not None:
                self._command(KVFailed(rid, why))
            else:
                self.held[rid] = (req.pairing.room, now)
        for rid, (room, since) in list(self.held.items()):
            if room in self.wants:
                want, _ = self.wants.pop(room)
                self.bound.discard(room)
                del self.held[rid]
                req = self.disagg.sending[rid]
                src = self.disagg.kv_of(rid, want["first"])
                self.inflight[rid] = room
                self.jobs.put((rid, room, want, [int(s) for s in src], req.output_ids[0], max(req.cached_tokens, 0)))
            elif now - since > self.timeout_s:
                del self.held[rid]
                self._fail_prefill(rid, room, f"no decode instance asked for room {room} within "
                                              f"engine.disaggregation_timeout_s={self.timeout_s:g}s (its KV held this "
                                              f"prefill pool meanwhile: a decode side with no slots for it and "
                                              f"requests waiting here for room is a deadlock, broken by failing it)")
        for room, since in list(self.cancelled.items()):
            if now - since > self.timeout_s and room not in self.inflight.values():
                del self.cancelled[room]
        if self.expired:
            live = {r.pairing.room for r in self.disagg.prefilling.values()}
            for room, (since, _, bound) in list(self.expired.items()):
                # unbound: a request later still than this parks until its own timeout; bound: until its request ends
                if (now - since > self.timeout_s) if not bound else room not in live:
                    del self.expired[room]
        for room, (since, _) in list(self.dropped.items()):
            if now - since > self.timeout_s:       # its want, if any, has timed out on the decode side by now
                del self.dropped[room]
        for room, (want, since) in list(self.wants.items()):
            if now - since > self.timeout_s:     # no request of that room came here, or (bound) its prefill stalled
                del self.wants[room]
                why = (f"the prefill instance did not prefill room {room} within {self.timeout_s:g}s of its "
                       f"destination" if room in self.bound else
                       f"the prefill instance got no request for room {room} within {self.timeout_s:g}s")
                # its request may still come (unbound) or is prefilling (bound): it has nowhere to go, so it fails
                # when it reaches this side's queue or finishes its prefill, not after holding its KV for a timeout
                self.expired[room] = (now, why, room in self.bound)
                self.bound.discard(room)
                self.push.send(want["notify"], {"op": "failed", "room": room, "error": why})
        while True:
            try:
                rid, ok, info = self.results.get_nowait()
            except queue.Empty:
                break
            self.inflight.pop(rid, None)
            if ok:
                self.stats_["kv_transfers"] += 1
                self.stats_["kv_transfer_bytes"] += info["bytes"]
                self.stats_["kv_transfer_s"] += info["seconds"]
                self._command(KVDone(rid, nbytes=info["bytes"], seconds=info["seconds"]))
            else:
                self.stats_["kv_transfer_failures"] += 1
                self._command(KVFailed(rid, info))

    def _admit_parked(self, now: float) -> None:
        """SGLang's order: let in each parked request whose room's want has come (its want's clock restarts: the
        prefill runs now); fail one whose room was cancelled or whose want timed out before it came (at once), or that
        waited past the timeout."""
        self.parked = {rid: t for rid, t in self.parked.items() if rid in self.disagg.bootstrapping}
        for rid, req in self.disagg.bootstrapping.items():
            if rid in self.closing:
                continue
            room, since = req.pairing.room, self.parked.setdefault(rid, now)
            if (why := self._room_gone(room)) is not None:
                self._command(KVFailed(rid, why))
            elif room in self.wants:
                self.wants[room] = (self.wants[room][0], now)
                self.bound.add(room)
                self.commands.append(KVBootstrapped(rid))   # (applied this step; not closing: it comes back held)
            elif now - since > self.timeout_s:
                self._fail_prefill(rid, room, f"no decode instance asked for room {room} within "
                                              f"engine.disaggregation_timeout_s={self.timeout_s:g}s (it waited for "
                                              f"its destination before prefilling, holding no KV: "
                                              f"engine.disaggregation_order=sglang)")

    def _room_gone(self, room: int) -> str | None:
        """Why a request of this room has no destination any more (the decode side cancelled it, or its want timed
        out here, before the request came or while it prefilled, and the decode side was failed then), or None."""
        if self.cancelled.pop(room, None) is not None:
            return "the decode side cancelled the room"
        if (expired := self.expired.pop(room, None)) is not None:
            when = "while this request prefilled" if expired[2] else "before this prefill request came"
            return (f"the decode side's want for room {room} timed out (engine.disaggregation_timeout_s="
                    f"{self.timeout_s:g}s) {when}: {expired[1]}; it has no destination")
        return None

    def _command(self, cmd) -> None:
        self.closing.add(cmd.rid)
        self.commands.append(cmd)

    def _fail_prefill(self, rid: str, room: int, why: str) -> None:
        self._command(KVFailed(rid, why))
        self._fail_room(room, why)

    def _fail_room(self, room: int, why: str) -> None:
        """This side gave up the room: answer its want now, or any that comes later (the decode side then frees
        its slots at once, not at its timeout)."""
        self.stats_["kv_transfer_failures"] += 1
        self.bound.discard(room)
        if room in self.wants:
            want, _ = self.wants.pop(room)
            self.push.send(want["notify"], {"op": "failed", "room": room, "error": why})
        else:
            self.dropped[room] = (time.monotonic(), why)

    def _send_loop(self) -> None:
        """The sender thread: write each job's KV into every decode rank's pool, then answer the decode side."""
        push = _Pushers(self.ctx)
        while (job := self.jobs.get()) is not None:
            rid, room, want, src, token, cached = job
            t0 = time.perf_counter()
            try:
                if room in self.cancelled:
                    raise TransferError("the room was cancelled")
                nbytes = self._write(want, src)
                seconds = time.perf_counter() - t0
                push.send(want["notify"], {"op": "done", "room": room, "token": token, "cached": cached,
                                           "bytes": nbytes, "seconds": seconds})
                self.results.put((rid, True, {"bytes": nbytes, "seconds": seconds}))
            except Exception as e:            # noqa: BLE001 - whatever stops a transfer fails its room, never the thread
                push.send(want["notify"], {"op": "failed", "room": room, "error": f"KV transfer failed: {e}"})
                self.results.put((rid, False, f"KV transfer failed: {e}"))
            finally:
                self.cancelled.pop(room, None)
        push.close()

    def _write(self, want: dict, src: list[int]) -> int:
        if want["backend"] != self.backend:
            raise ValueError(f"the decode instance uses the {want['backend']} transport, this prefill instance "
                             f"{self.backend}: set the same engine.disaggregation_transfer_backend on both")
        dst = want["slots"]
        if len(dst) != len(src):
            raise ValueError(f"the decode side wants {len(dst)} tokens' KV, this side holds {len(src)}")
        me, total = self.layout, 0
        for peer in (PoolLayout(**r) for r in want["ranks"]):
            if (peer.slot_bytes, peer.layers) != (me.slot_bytes, me.layers):
                raise ValueError(f"the decode instance's KV layout ({peer.layers} layers x {peer.slot_bytes} bytes "
                                 f"a token) is not this one's ({me.layers} x {me.slot_bytes}): not the same model")
            per_layer = [[(me.addr(layer, s), peer.addr(layer, d), me.slot_bytes) for s, d in zip(src, dst)]
                         for layer in range(me.layers)]
            if self.layerwise:
                for ops in per_layer:
                    self.transport.write(peer.endpoint, ops)
            else:
                self.transport.write(peer.endpoint, [op for ops in per_layer for op in ops])
            total += len(src) * me.layers * me.slot_bytes
        return total

    # -- decode ---------------------------------------------------------------------------------------------
    def _on_decode_msg(self, msg: dict, now: float) -> None:
        rid = self.by_room.pop(msg["room"], None)
        if rid is None or rid not in self.asked:
            return
        del self.asked[rid]
        if msg["op"] == "done":
            self.stats_["kv_transfers"] += 1
            self.stats_["kv_transfer_bytes"] += msg["bytes"]
            self.stats_["kv_transfer_s"] += msg["seconds"]
            self.commands.append(KVDone(rid, msg["token"], msg["cached"], msg["bytes"], msg["seconds"]))
        else:
            self.stats_["kv_transfer_failures"] += 1
            self.commands.append(KVFailed(rid, msg["error"]))

    def allocated_elsewhere(self, event: KVAllocated) -> None:
        """Rank 0: another DP group's leader pre-allocated a request's slots (asked for at the next poll)."""
        self._elsewhere.append(event)

    def _decode_poll(self, now: float) -> None:
        for dest in self.disagg.take_allocated():
            req = self.disagg.receiving[dest.rid]
            if dest.rid in self.disagg.abandoned:      # the client left before its slots came
                self.push.send(self._bootstrap(req.pairing), {"op": "cancel", "room": req.pairing.room,
                                                              "notify": self.address})
                self.commands.append(KVFailed(dest.rid, "aborted"))
            else:
                self._ask(dest, req.pairing, 0, now)
        for event in self._elsewhere:
            if self._aborted.pop(event.dest.rid, None) is not None:
                self.push.send(self._bootstrap(event.pairing), {"op": "cancel", "room": event.pairing.room,
                                                                "notify": self.address})
                self.commands.append(KVFailed(event.dest.rid, "aborted"))
            else:
                self._ask(event.dest, event.pairing, event.group, now)
        self._elsewhere = []
        for rid, since in list(self._aborted.items()):
            if now - since > self.timeout_s:
                del self._aborted[rid]
        for rid, (room, bootstrap, since) in list(self.asked.items()):
            if now - since > self.timeout_s:
                del self.asked[rid]
                self.by_room.pop(room, None)
                self.push.send(bootstrap, {"op": "cancel", "room": room, "notify": self.address})
                self.stats_["kv_transfer_failures"] += 1
                self.commands.append(KVFailed(rid, f"no KV from the prefill instance at {bootstrap} (room {room}) "
                                                   f"within engine.disaggregation_timeout_s={self.timeout_s:g}s"))

    @staticmethod
    def _bootstrap(p: Pairing) -> str:
        return f"tcp://{p.host}:{p.port}"

    def _ask(self, dest: Destination, p: Pairing, group: int, now: float) -> None:
        """Send the prefill side a room's want: where every rank of DP group `group` wants the KV."""
        bootstrap = self._bootstrap(p)
        self.asked[dest.rid] = (p.room, bootstrap, now)
        self.by_room[p.room] = dest.rid
        ranks = [vars(layout) for layout, g in zip(self.layouts, self.rank_groups) if g == group]
        self.push.send(bootstrap, {"op": "want", "room": p.room, "notify": self.address, "backend": self.backend,
                                   "first": dest.first, "slots": dest.slots, "ranks": ranks})
