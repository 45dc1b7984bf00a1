"""Prefill/decode disaggregation in mode=sim (issue 20, item 6): the real path's roles, queues and deciders on the
virtual clock, with the KV transfer priced from its bytes on shared links.

- Roles: each simulated instance runs the engine's own scheduler with its `engine.role` (cluster.roles), so a prefill
  instance runs a paired request with max_new_tokens 1 and holds its KV until it is sent, and a decode instance
  pre-allocates the request's row and slots (framework/engine/disagg.py, SGLang's order and reserve) before the KV can
  land. Nothing here re-implements those queues: this module only moves the KV between them.
- Routing: the router core's pair dispatch (framework/routing/pairs.py `dispatch_pair`: the policy's `select_pair`
  for `router.pd_decider=always`, llm-d's decode-first rule or Dynamo's conditional rule otherwise), on the simulated
  router's core and clock. A request the decider keeps local is prefilled on its decode instance (which must have
  `engine.disaggregation_local_prefill`, as on the real path).
- Order (`sim.pd_order`): `sglang`, a prefill half reaches its prefill instance once the decode instance has
  pre-allocated its slots; `distserve`, the prefill at once and its KV held until a destination exists (DistServe's
  pull, and servelab's real path).
- The transfer: (prompt tokens the decode side lacks) x `kv_bytes_per_token` bytes, from the moment both halves are
  ready (the prefill finished, the destination pre-allocated), over the link between the two instances: NVLink when
  they share a node, the NICs otherwise (placement: instances fill `hardware.gpus_per_node`-GPU nodes in order, each
  on `parallel.size` GPUs). One GPU's link is the cost model's `kv_link` (bandwidth, latency); a transfer uses
  min(sender, receiver GPUs) of them in parallel, and every instance's egress and ingress of each kind (size x one
  link) is shared equally among the transfers on it (processor sharing, re-rated at every start and end: contention).
  Per layer (`engine.disaggregation_layerwise`): the layers but the last are sent while the prefill step runs, when
  the destination was known before that step began, so only what the step's duration could not cover is left after
  it (at least one layer's bytes).

The cluster (framework/sim/cluster.py) calls `send`, `started`, `prefilled` and `lands` at its own events, and this
module's `PD` events come back through `on_event`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from framework.contracts.routing import RequestView
from framework.core.registry import PARALLELISM
from framework.engine.config import Role
from framework.engine.disagg import Pairing
from framework.engine.request import Req
from framework.routing.pairs import ALWAYS, DECIDERS, dispatch_pair, role_policies
from framework.sim.cluster import ARRIVE, CLIENT, PD_EVENT, _Flight
from framework.sim.router import usage_of

EPS_BYTES = 1e-6
SGLANG, DISTSERVE = "sglang", "distserve"
PD_ORDERS = (SGLANG, DISTSERVE)   # sim.pd_order


@dataclass(eq=False)
class Flow:
    """One KV transfer on the links: `remaining` bytes from instance `src` to `dst`."""
    key: str
    src: str
    dst: str
    intra: bool                # NVLink (same node) or the NICs
    remaining: float
    lanes: int                 # GPU links used in parallel
    latency: float
    rate: float = 0.0


class LinkNet:
    """KV transfers in flight between instances. Each instance has, per link kind, an egress and an ingress of
    `size` x one GPU's link, shared equally by the transfers on it; a transfer goes at the least of its shares and of
    its own lanes, its last byte landing `latency` after it drains."""

    def __init__(self, cost, gpus: dict[str, int], nodes: dict[str, int]):
        self.cost, self.gpus, self.nodes = cost, gpus, nodes
        self.links = {intra: cost.kv_link(intra) for intra in (True, False)}
        self.flows: dict[str, Flow] = {}
        self.landing: list[tuple[float, str]] = []     # drained flows: (landing time, key)
        self.t = 0.0

    def intra(self, src: str, dst: str) -> bool:
        return self.nodes[src] == self.nodes[dst]

    def start(self, now: float, key: str, src: str, dst: str, nbytes: float) -> None:
        self.advance(now)
        intra = self.intra(src, dst)
        flow = Flow(key, src, dst, intra, float(nbytes), min(self.gpus[src], self.gpus[dst]), self.links[intra][1])
        if flow.remaining <= EPS_BYTES:
            self.landing.append((now + flow.latency, key))
            return
        self.flows[key] = flow
        self._rate()

    def _rate(self) -> None:
        out, into = {}, {}
        for f in self.flows.values():
            out[f.src, f.intra] = out.get((f.src, f.intra), 0) + 1
            into[f.dst, f.intra] = into.get((f.dst, f.intra), 0) + 1
        for f in self.flows.values():
            bw = self.links[f.intra][0]
            f.rate = min(f.lanes * bw, self.gpus[f.src] * bw / out[f.src, f.intra],
                         self.gpus[f.dst] * bw / into[f.dst, f.intra])

    def advance(self, now: float) -> None:
        """Move every flow's bytes on to `now` (re-rating as flows drain)."""
        while self.flows:
            first = min(f.remaining / f.rate for f in self.flows.values())
            if self.t + first > now + 1e-12:            # none drains by now: all move on at their rates
                dt = max(now - self.t, 0.0)
                for f in self.flows.values():
                    f.remaining -= f.rate * dt
                break
            self.t += first                               # the first to drain: it (and any as close) lands
            for f in list(self.flows.values()):
                if f.remaining / f.rate <= first * (1 + 1e-9) + 1e-15:
                    del self.flows[f.key]
                    self.landing.append((self.t + f.latency, f.key))
                else:
                    f.remaining -= f.rate * first
            self._rate()
        self.t = max(self.t, now)

    def landed(self, now: float) -> list[tuple[float, str]]:
        """The transfers whose last byte has landed by `now`, (time, key) in order."""
        self.advance(now)
        done = sorted(x for x in self.landing if x[0] <= now + 1e-12)
        self.landing = [x for x in self.landing if x[0] > now + 1e-12]
        return done

    def next_time(self) -> float | None:
        """When the next transfer lands or drains (None: nothing in flight)."""
        times = [t for t, _ in self.landing]
        if self.flows:
            times.append(self.t + min(f.remaining / f.rate for f in self.flows.values()))   # (drains then, exactly)
        return min(times) if times else None


@dataclass(eq=False)
class _Pair:
    decode: object                      # the decode half's flight (the client's request)
    prefill: object                     # the prefill half's flight
    prefill_done: float | None = None
    dest_first: int | None = None       # prompt tokens the decode side already holds (its destination is known)
    dest_time: float = 0.0
    step: tuple[float, float] = (0.0, 0.0)   # the prefill's last step: (start, duration)
    sent_at: float | None = None        # when the transfer began (per layer: the prefill's last step)
    nbytes: int = 0
    landed: bool = False


@dataclass
class PDStats:
    transfers: int = 0
    local_prefills: int = 0
    bytes: int = 0
    transfer_s: list = field(default_factory=list)
    slot_wait_s: list = field(default_factory=list)    # decode side: from a request's arrival to its slots


def instance_config(cfg, role: Role):
    """`cfg` with `engine.role` = role (a copy; the run's own config is left alone)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, role=role))
    out = copy.deepcopy(cfg)
    out.engine.role = role
    return out


def placement(names: list[str], sizes: dict[str, int], gpus_per_node: int) -> dict[str, int]:
    """Each instance's node: instances fill nodes of `gpus_per_node` GPUs in order, `sizes[name]` GPUs each."""
    nodes, gpu = {}, 0
    for n in names:
        if gpu // gpus_per_node != (gpu + sizes[n] - 1) // gpus_per_node:   # would straddle: start the next node
            gpu = -(-gpu // gpus_per_node) * gpus_per_node
        nodes[n], gpu = gpu // gpus_per_node, gpu + sizes[n]
    return nodes


class PD:
    """The disaggregation of one simulation: which instance has which role, the pair routing and the transfers."""

    def __init__(self, sim, roles: dict[str, Role], cfgs: dict, cost, router_cfg,
                 prefill_after_slots: bool | None = None):
        self.sim, self.roles, self.cost = sim, roles, cost
        # SGLang's order (disaggregation/prefill.py's bootstrap queue): a prefill half is queued once its decode
        # instance has pre-allocated its slots, so held KV always has somewhere to go. False: DistServe's (and
        # servelab's real path's) order: the prefill runs at once and holds the KV until its destination is known,
        # which can deadlock when held KV and waiting prompts fill both sides (a prompt waiting for prefill room
        # behind KV whose destination waits behind it)
        if prefill_after_slots is None:         # the run's sim.pd_order
            order = getattr(getattr(next(iter(cfgs.values())), "sim", None), "pd_order", SGLANG)
            if order not in PD_ORDERS:
                raise ValueError(f"sim.pd_order={order!r} is not one of {', '.join(PD_ORDERS)}")
            prefill_after_slots = order == SGLANG
        self.prefill_after_slots = prefill_after_slots
        self.prefill = [n for n, r in roles.items() if r is Role.prefill]
        self.decode = [n for n, r in roles.items() if r is Role.decode]
        if not self.prefill or not self.decode or len(self.prefill) + len(self.decode) != len(roles):
            raise ValueError(f"disaggregated serving needs at least one prefill and one decode instance and no mixed "
                             f"one beside them; got {[r.value for r in roles.values()]}")
        self.decider = getattr(router_cfg, "pd_decider", ALWAYS)
        if self.decider not in DECIDERS:
            raise ValueError(f"router.pd_decider={self.decider!r} is not one of {', '.join(DECIDERS)}")
        self.max_local = int(getattr(router_cfg, "pd_local_prefill_max_tokens", 0))
        self.max_queue = int(getattr(router_cfg, "pd_max_prefill_queue", 1 << 30))
        self.bytes_per_token = float(getattr(router_cfg, "pd_bytes_per_token", 1.0))
        core = sim.router.core      # a policy instance per role, as sglang-router (router.prefill_policy/decode_policy)
        core.set_role_policies(role_policies(core.policy, getattr(router_cfg, "prefill_policy", None),
                                             getattr(router_cfg, "decode_policy", None)))
        for n, r in roles.items():
            core.set_role(n, r.value)
        for n in self.decode:
            core.workers[n].local_prefill = bool(cfgs[n].engine.disaggregation_local_prefill)
        self.kv_bytes = {n: PARALLELISM.get(c.parallel.name).kv_bytes_per_token(c.model) for n, c in cfgs.items()}
        self.layers = {n: c.model.num_layers for n, c in cfgs.items()}
        self.layerwise = {n: bool(c.engine.disaggregation_layerwise) for n, c in cfgs.items()}
        sizes = {n: int(c.parallel.size) for n, c in cfgs.items()}
        hw = next(iter(cfgs.values())).hardware
        self.nodes = placement(list(roles), sizes, int(hw.gpus_per_node))
        self.net = LinkNet(cost, sizes, self.nodes)
        self.pairs: dict[str, _Pair] = {}
        self.last_step: dict[str, tuple[float, float]] = {}   # a prefill instance's last step: (start, seconds)
        self.rooms = 0
        self.version = 0
        self.stats = PDStats()

    # -- the client's request at the router ------------------------------------------------------------------------
    def send(self, now: float, s, k: int, ids: list[int], text: str, params) -> None:
        """The client sends turn k of session s at `now`: the router core picks its pair (or its decode instance
        alone) and both halves travel to their instances."""
        sim = self.sim
        at_router = now + sim.net
        sim.router.now = at_router
        core = sim.router.core
        plan = dispatch_pair(core, RequestView(text, ids, params.max_new_tokens),
                             [core.workers[n] for n in self.prefill], [core.workers[n] for n in self.decode],
                             self.decider, self.max_local, self.max_queue, self.bytes_per_token)
        at_server = at_router + sim.outside() + sim.net
        rid = f"{s.sid}/{k}"
        dw = plan.decode.worker.url
        req = Req(ids, params, rid=rid, arrival_time=sim.frontends[dw].tokenize(at_server, len(ids)))
        flight = plan.decode.ref = _Flight(s, k, req, dw, plan.decode, now)
        sim.flights[rid] = flight
        if plan.prefill is None:                 # the decider keeps it local: the decode instance serves it whole
            self.stats.local_prefills += 1
            flight.tell_first = core.tells_first_token(plan.decode)   # its first token comes from the decode instance
            sim.push(req.arrival_time, ARRIVE, dw, flight)
            return
        pw = plan.prefill.worker.url
        self.rooms += 1
        req.pairing = Pairing(self.rooms, pw, 0)
        preq = Req(list(ids), params, rid=rid, arrival_time=sim.frontends[pw].tokenize(at_server, len(ids)))
        preq.pairing = req.pairing
        half = plan.prefill.ref = _Flight(s, k, preq, pw, plan.prefill, now)
        self.pairs[rid] = _Pair(flight, half)
        if not self.prefill_after_slots:           # DistServe's order: prefill at once, the KV held until pulled
            sim.push(preq.arrival_time, ARRIVE, pw, half)
        sim.push(req.arrival_time, ARRIVE, dw, flight)

    # -- hooks the cluster calls -----------------------------------------------------------------------------------
    def started(self, now: float, worker: str, seconds: float | None) -> None:
        """A step was formed on `worker` at `now` (None: none): a decode instance may have pre-allocated slots; a
        prefill instance's step is remembered (the per-layer overlap)."""
        inst = self.sim.instances[worker]
        if self.roles[worker] is Role.decode:
            for g in inst.groups:
                for dest in g.disagg.take_allocated():
                    pair = self.pairs[dest.rid]
                    pair.dest_first, pair.dest_time = dest.first, now
                    self.stats.slot_wait_s.append(now - pair.decode.req.arrival_time)
                    if self.prefill_after_slots:   # SGLang's order: the destination reaches the prefill's bootstrap
                        half = pair.prefill
                        half.req.arrival_time = max(half.req.arrival_time, now + self.sim.net)
                        self.sim.push(half.req.arrival_time, ARRIVE, half.worker, half)
                    self._try_send(now, pair)
        elif seconds is not None:
            self.last_step[worker] = (now, seconds)

    def prefilled(self, now: float, worker: str, req: Req) -> bool:
        """`req` got a token on `worker` at `now`: True when it is a prefill half (the cluster leaves it to us)."""
        if self.roles[worker] is not Role.prefill:
            return False
        pair = self.pairs[req.rid]
        if req.finished:                   # the prefill half's one token: its prompt phase ended here
            self.sim.router.first_token(pair.prefill.attempt, now + self.sim.net)
            pair.prefill_done = now
            pair.step = self.last_step.get(worker, (now, 0.0))
            self._try_send(now, pair)
        return True

    def lands(self, now: float, worker: str, flight) -> bool:
        """The decode half of a transfer that landed reaches its scheduler (True: done here; False: a plain arrival)."""
        pair = self.pairs.get(flight.req.rid)
        if pair is None or pair.decode is not flight or not pair.landed:
            return False
        del self.pairs[flight.req.rid]
        sim, pre = self.sim, pair.prefill.req
        for g in sim.instances[worker].groups:
            if flight.req.rid in g.disagg.receiving:
                req = g.disagg.arrived(flight.req.rid, pre.output_ids[0], pre.cached_tokens, now)
                break
        else:
            raise RuntimeError(f"request {flight.req.rid} landed on {worker}, which is not receiving it")
        req.kv_transfer_bytes, req.kv_transfer_s = pair.nbytes, now - pair.sent_at
        self.stats.transfer_s.append(req.kv_transfer_s)
        if sim.itl:
            flight.times.append(now)
        if req.finished:                       # one token asked for: the prefill's was the answer
            sim.instances[worker].answers.pop(req.rid, None)
            sim.router.done(flight.attempt, now + sim.net, usage=usage_of(req))
            sim.push(now + 2 * sim.net, CLIENT, "done", flight)
        return True

    def on_event(self, now: float, version: int) -> None:
        if version != self.version:
            return
        sim = self.sim
        for t, rid in self.net.landed(now):
            pair = self.pairs[rid]
            pair.landed = True
            pw, pre = pair.prefill.worker, pair.prefill.req
            for g in sim.instances[pw].groups:       # the prefill instance lets the KV go
                g.disagg.sent(rid)
            sim.instances[pw].answers.pop(rid, None)
            sim.router.done(pair.prefill.attempt, t + sim.net, usage=usage_of(pre))
            sim.kick(now, pw)                        # its freed KV may let waiting requests in
            sim.push(now, ARRIVE, pair.decode.worker, pair.decode)
        self._schedule()

    # -- the transfer ------------------------------------------------------------------------------------------------
    def _try_send(self, now: float, pair: _Pair) -> None:
        if pair.prefill_done is None or pair.dest_first is None or pair.sent_at is not None:
            return
        pw, dw = pair.prefill.worker, pair.decode.worker
        tokens = len(pair.decode.req.prompt_ids) - pair.dest_first
        pair.nbytes = nbytes = tokens * self.kv_bytes[pw]
        self.stats.transfers += 1
        self.stats.bytes += nbytes
        left = nbytes
        if self.layerwise[pw]:
            start, seconds = pair.step
            layers = max(self.layers[pw], 1)
            if pair.dest_time <= start and seconds > 0:   # the layers before the last went out during the step
                bw, _ = self.cost.kv_link(self.net.intra(pw, dw))
                lanes = min(self.net.gpus[pw], self.net.gpus[dw])
                covered = bw * lanes * seconds * (layers - 1) / layers
                left = max(nbytes / layers, nbytes - covered)
        pair.sent_at = now if not self.layerwise[pw] else min(now, pair.step[0])
        self.net.start(now, pair.decode.req.rid, pw, dw, left)
        self._schedule()

    def _schedule(self) -> None:
        t = self.net.next_time()
        self.version += 1
        if t is not None:
            self.sim.push(max(t, self.sim.now), PD_EVENT, self.version)

    def describe(self) -> dict:
        """What results.json says of the disaggregation."""
        st = self.stats
        xs = sorted(st.transfer_s)
        return {"pd_prefill_instances": len(self.prefill), "pd_decode_instances": len(self.decode),
                "pd_decider": self.decider, "pd_local_prefill_max_tokens": self.max_local,
                "pd_transfers": st.transfers, "pd_local_prefills": st.local_prefills, "pd_transfer_bytes": st.bytes,
                "pd_transfer_p50_s": xs[len(xs) // 2] if xs else 0.0,
                "pd_transfer_p99_s": xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else 0.0}
