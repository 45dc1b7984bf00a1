"""The discrete-event simulation of a cluster: a load client playing the workload as framework/load/inprocess.py
does (open loop at the sessions' arrival times, closed loop at workload.max_concurrency, multi-turn prompts that hold
the earlier answers, think times), the router (framework/sim/router.py) and the simulated instances.

A request sent at t reaches the router at t + network, its instance at t + 2 x network + the router's overhead; each
token reaches the client 2 x network after its step ends. An instance steps while it has work: a step's batches are
formed when it starts (an arrival joins at the next step, as in the engine) and its tokens land when it ends. With
`fast_forward`, a run of plain decode steps is one event; an arrival during the run cuts it after the step it falls
in, so the decisions and times are those of stepping one at a time.

`host_cores` > 0 models instances that share a CPU host (this machine). The busy processes are the busy instances'
ranks, `side_procs` more (the router process and the load client over HTTP: `sim.host_side_procs`) while any request
is in flight, and `background` busy processes of other work all along. How they share the cores (`sim.host_sharing`):
- `at_start` (the default, as every committed figure): a step is stretched by the busy processes at its start over
  the cores, when they outnumber them, and keeps that stretch to its end. Not work-conserving: a long step begun
  while few were busy runs at full speed after others start, so the host can do more work than it has cores for;
- `fair`: processor sharing as the kernel's scheduler approximates it. Every busy process progresses at cores / busy
  (at most 1) of its unstretched speed, re-timed whenever the number of busy processes changes, so the host never
  does more than its cores' work. Steps are taken one at a time (no fast-forwarded runs: each step's end moves with
  the sharing).
With `host_contention` c > 1 (`sim.host_contention`), a busy core also runs slower the more cores are busy: by
1 + (c - 1) (used - 1) / (cores - 1), used = min(busy, cores) (cores that share a physical core or its caches; this
VM's two vCPUs: 0.93-1.25x with both busy, by the hour). A price was measured with its own ranks busy (experiments/calibrate: one
instance alone), so an instance's steps stretch by that factor now over the factor at its ranks (min(size, cores)):
a one-rank instance priced alone slows when the others are busy, a two-rank one on two cores was priced so already.
`host_contention_extend` (when set) is the factor of steps that extend, `host_contention` then the decode steps'
(this VM: the real engines' extend CPU rose 1.07x under load, their decode CPU 1.2-1.4x).
`host_contention_busy` b (when set) is the busy processes the factors were measured with (experiments/calibrate/
contention.py: 4 engines on 2 cores, where one sibling read 1.06 and three 1.25): the slowing is then
1 + (c - 1) (used - 1) / (b - 1), used = min(busy, b), in place of the cores.
`outside_busy_s` o (`sim.outside_busy_s`, over HTTP) is the time a request spends outside the engines (client,
router, HTTP hand-off) beyond the router's own, with every core busy with steps: on a CPU host those processes wait
for a core. A request sent while busy ranks fill a share u = min(1, busy ranks / cores) of the cores reaches its
instance o x u later (this VM, the round-robin cells: 3.0-3.3 ms outside the engines one request at a time, 8.9-9.6
at 4 in flight, 11.2-11.3 at 16: experiments/sim_fidelity/outside_load.py). Only the steps' ranks count as busy.
`outside_cv` c (`sim.outside_cv`, over HTTP) spreads that time: each request's is its mean (the router's time plus
o x u) times a draw of a gamma of mean 1 and coefficient of variation c (`sim.outside_seed`'s stream). The real
requests' times outside the engines are as spread as an exponential's (this VM, 16 in flight: CV 0.8-1.0, p10 2 ms,
p90 20); with every request at the mean, the arrivals at a worker keep one order run after run, and so does which
cached prefix survives until its next request (experiments/sim_fidelity, round R).
`host_steal` s (`sim.host_steal`, in cores) is the cores' time the hypervisor gives to other guests: no process here
runs then, whatever the sharing. Each core runs a share 1 - s / cores of the time, independently, and an instance's
ranks wait for one another at every collective, so it advances only while all of its cores run: (1 - s / cores) ^
min(size, cores) of its speed. Counted as busy processes instead (`host_background`), steal would slow a two-rank
instance on two cores by 1 + s / 2, where it stalls it by 1 / (1 - s / 2)^2 (this VM: 0-0.5 cores stolen, by the hour).

Prefill/decode disaggregation (`cluster.roles`): `pd` (framework/sim/pd.py) routes each request to a pair, or to its
decode instance alone, and moves the KV between them on the simulated links; the hooks here hand it the prefill
halves' tokens, the decode instances' pre-allocations and the landed transfers.
"""
from __future__ import annotations

import heapq
import random
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

from tqdm import tqdm

from framework.engine.request import Req, SamplingParams
from framework.core.records import RequestRecord
from framework.contracts.workload import Session
from framework.load.sessions import DueTurns, not_sent
from framework.routing.core import Attempt, route_fields
from framework.routing.dp_aware import dp_rank_of
from framework.sim.frontend import FrontEnd
from framework.sim.router import usage_of

ARRIVE, STEP, CLIENT, MAINTAIN, POLL, HOLD = range(6)    # the order of events at one instant
PD_EVENT = 6                                  # a KV transfer drained or landed (framework/sim/pd.py)
START = 7           # batch_arrivals: an idle instance starts, after every other event of its instant (its arrivals)
MAX_RUN = 64                                  # decode steps one event advances at most
HOST_SHARING = ("at_start", "fair")           # sim.host_sharing: how busy processes share host_cores (module doc)
MAX_OUTSIDE_CV = 10.0   # sim.outside_cv's ceiling: a gamma's shape 1/CV^2 below 0.01 is a point at 0 and rare giants


def slowdown(c: float, used: float, at: float) -> float:
    """How much slower a busy process runs with ``used`` processes busy than alone, on a host that runs ``c`` times
    slower with ``at`` busy (``contention``, measured there: every core busy by default): linear in the others busy,
    and no slower past ``at``."""
    if c == 1.0 or at <= 1:
        return 1.0
    used = min(max(used, 1.0), at)
    return 1.0 + (c - 1.0) * (used - 1.0) / (at - 1)


@dataclass(eq=False)  # a flight is itself: found by identity
class _Flight:
    session: Session
    turn: int
    req: Req
    worker: str
    attempt: Attempt                                    # the router's: its decision, held or not
    send_s: float
    times: list[float] = field(default_factory=list)    # when each token was produced (ITL)
    tell_first: bool = False                            # its first token is still to be told to the router's policy


@dataclass
class _State:
    """An instance's place in the simulation: idle, one step, or a run of k decode steps ending at `ends`."""
    busy: bool = False
    starting: bool = False                        # batch_arrivals: its start is due once this instant's arrivals are in
    version: int = 0
    run_start: float = 0.0
    ends: list[float] | None = None
    times: list[float] | None = None              # the run's steps as they take on the host (stretched)...
    priced: list[float] | None = None             # ...and as the cost model priced them (what the instance counts)
    held: list = field(default_factory=list)      # arrivals during a run: queued when it ends, as the engine would
    left: float = 0.0                             # host_sharing=fair: the step's unstretched seconds still to run...
    since: float = 0.0                            # ...as of this time, ...
    speed: float = 1.0                            # ...at this speed against its price, ...
    kind: str = "decode_cpu_s"                    # ...a step of this kind (STEP_CPU_KEYS)


class Simulation:
    def __init__(self, instances: dict, router, sessions: list[Session], wl_cfg, tokenizer, *, network_s: float = 0.0,
                 router_s: float = 0.0, fast_forward: bool = True, host_cores: int = 0, side_procs: float = 0,
                 background: float = 0.0, itl: bool = True, progress: bool = False, host_sharing: str = "at_start",
                 host_contention: float = 1.0, host_contention_extend: float | None = None,
                 host_contention_busy: float | None = None, host_steal: float = 0.0, batch_arrivals: bool = False,
                 outside_busy_s: float = 0.0, outside_cv: float = 0.0, outside_seed: int = 0):
        self.instances, self.router, self.sessions, self.wl = instances, router, sessions, wl_cfg
        self.tokenizer = tokenizer                  # the instances' own: prompts in, answers out
        self.net, self.router_s, self.ff, self.cores, self.itl = network_s, router_s, fast_forward, host_cores, itl
        self.side_procs, self.background, self.batch_arrivals = side_procs, background, batch_arrivals
        if host_sharing not in HOST_SHARING:
            raise ValueError(f"sim.host_sharing={host_sharing!r} is not one of {HOST_SHARING}")
        self.fair = bool(host_cores) and host_sharing == "fair"
        extend = host_contention if host_contention_extend is None else host_contention_extend
        for key, c in (("host_contention", host_contention), ("host_contention_extend", extend)):
            if not c > 0:
                raise ValueError(f"sim.{key}={c} must be > 0 (1: cores that do not slow each other)")
        self.contention = {"decode_cpu_s": host_contention, "extend_cpu_s": extend}   # by step kind (STEP_CPU_KEYS)
        if host_contention_busy is not None and not host_contention_busy >= 1:
            raise ValueError(f"sim.host_contention_busy={host_contention_busy} must be >= 1 (the busy processes the "
                             f"contention was measured with), or null for sim.host_cores")
        self.contention_at = host_cores if host_contention_busy is None else host_contention_busy
        if host_steal and not host_cores:
            raise ValueError(f"sim.host_steal={host_steal} needs sim.host_cores > 0 (the cores it is taken from)")
        if not 0.0 <= host_steal < max(host_cores, 1):
            raise ValueError(f"sim.host_steal={host_steal} must be >= 0 and below sim.host_cores={host_cores} (the "
                             f"cores' time taken by the hypervisor, in cores)")
        self.core_up = 1.0 - host_steal / host_cores if host_cores else 1.0   # the share of the time a core runs
        if outside_busy_s < 0:
            raise ValueError(f"sim.outside_busy_s={outside_busy_s} must be >= 0 (0: none)")
        if outside_busy_s and not host_cores:
            raise ValueError(f"sim.outside_busy_s={outside_busy_s} needs sim.host_cores > 0 (the cores whose busy "
                             f"share it scales with)")
        self.outside_busy_s = outside_busy_s
        if not 0 <= outside_cv <= MAX_OUTSIDE_CV:            # (NaN too: a gamma draw of it never returns)
            raise ValueError(f"sim.outside_cv={outside_cv} must be between 0 (every request waits the mean) and "
                             f"{MAX_OUTSIDE_CV}")
        self.outside_cv, self.outside_rng = outside_cv, random.Random(outside_seed)
        self.waits = [0, 0.0]                       # the means drawn around: how many, and their squares' sum
        self.send_busy = [0.0, 0]                   # the cores' busy share at each send, summed, and the sends
        self.shared_busy = 0.0                      # fair sharing: the busy processes the steps' speeds were set for
        if self.fair:
            self.ff = False                         # a run's steps would move with the sharing: one at a time
        self.state = {name: _State() for name in instances}
        self.frontends = {name: FrontEnd(getattr(inst.cost, "cfg", None)) for name, inst in instances.items()}
        self.progress = progress
        self.heap: list = []
        self.seq = 0
        self.busy_ranks = 0
        self.flights: dict[str, _Flight] = {}
        self.now = 0.0                              # the time of the event being handled
        router.on_release = self._release
        self.pd = None               # prefill/decode disaggregation (framework/sim/pd.py's PD), set by the builder
        self.records: list[RequestRecord] = []
        self.end = 0.0

    def push(self, t: float, kind: int, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, payload))

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> tuple[list[RequestRecord], float]:
        self.answers: dict[str, list[str]] = {s.sid: [] for s in self.sessions}
        self.pending = DueTurns([], self.wl.max_concurrency)   # due turns, sent once concurrency allows
        for s in self.sessions:
            self.push(s.arrival_s, CLIENT, "due", s, 0)
        self.ticks = 0                        # periodic events in the heap: they recur while anything else is there
        for interval, kind in ((self.router.interval, MAINTAIN), (self.router.load_interval, POLL)):
            if interval > 0:
                self.push(interval, kind)
                self.ticks += 1
        total = sum(len(s.turns) for s in self.sessions)
        self.bar = tqdm(total=total, desc="simulated requests", disable=not self.progress, leave=False,
                        mininterval=0.5)
        handlers = {ARRIVE: self._arrive, STEP: self._step, CLIENT: self._client, MAINTAIN: self._maintain,
                    POLL: self._poll, HOLD: self._hold_over, PD_EVENT: lambda t, *a: self.pd.on_event(t, *a),
                    START: self._start_after_arrivals}
        heap = self.heap
        fair = self.fair
        while heap:
            t, kind, _, payload = heapq.heappop(heap)
            self.now = t
            handlers[kind](t, *payload)
            if fair:
                self._reshare(t)
        self.bar.close()
        if self.flights or self.pending:      # the engine would spin: say so rather than lose requests
            raise RuntimeError(f"the simulation stalled with {len(self.flights)} request(s) in flight on idle "
                               f"instances (a scheduler that forms no batch while requests wait)")
        return self.records, self.end

    def _maintain(self, now: float) -> None:
        self.router.maintain(now)
        if len(self.heap) >= self.ticks:
            self.push(now + self.router.interval, MAINTAIN)

    def _poll(self, now: float) -> None:
        """The router's load poll: every instance's report reaches it at once (the HTTP round trip is not simulated)."""
        self.router.report_loads(now, {name: inst.load_report() for name, inst in self.instances.items()})
        if len(self.heap) >= self.ticks:
            self.push(now + self.router.load_interval, POLL)

    # -- the client ---------------------------------------------------------------------------------------------
    def _client(self, now: float, what: str, *args) -> None:
        if what == "due":
            self.pending.add(now, *args)
        elif what == "done":
            self._receive(now, args[0])
        while (due := self.pending.pop(now, len(self.flights))) is not None:
            self._send(now, *due)

    def _send(self, now: float, s: Session, k: int) -> None:
        turn = s.turns[k]
        text = s.prompt(k, self.answers[s.sid])
        params = SamplingParams(max_new_tokens=turn.max_new_tokens, temperature=self.wl.temperature,
                                ignore_eos=self.wl.ignore_eos)
        at_router = now + self.net
        ids = self.tokenizer.encode(text, add_bos=getattr(self.wl, "bos", False))   # workload.bos: the server's BOS
        if self.pd is not None:                   # a prefill/decode pair, or the decode instance alone
            self.pd.send(now, s, k, ids, text, params)
            return
        att, hold = self.router.send(text, ids, at_router, turn.max_new_tokens)
        req = Req(ids, params, rid=f"{s.sid}/{k}", arrival_time=at_router)   # (its arrival: set as it leaves)
        flight = att.ref = _Flight(s, k, req, att.worker.url, att, now,
                                   tell_first=self.router.core.tells_first_token(att))
        self.flights[req.rid] = flight
        if hold > 0:           # its prefix is being prefilled there: it waits for the events, or for the hold to end
            self.push(at_router + hold, HOLD, flight)
            return
        self._forward(at_router, flight)

    def _release(self, released: list[Attempt]) -> None:
        """A KV event let these held requests go: send them."""
        for att in released:
            self._unhold(att.ref)

    def _hold_over(self, now: float, flight: _Flight) -> None:
        if self.router.hold_over(flight.attempt, now):    # not released by an event before
            self._unhold(flight)

    def outside(self) -> float:
        """The router's time and, with outside_busy_s, the wait outside the engines at the cores' busy share now; with
        outside_cv, this request's draw around that mean."""
        mean = self.router_s
        if self.cores:
            share = min(1.0, self.busy_ranks / self.cores)
            self.send_busy[0] += share
            self.send_busy[1] += 1
            mean += self.outside_busy_s * share
        self.waits[0] += 1
        self.waits[1] += mean * mean
        if not self.outside_cv:
            return mean
        shape = self.outside_cv ** -2                  # a gamma of mean 1 and this CV
        return mean * self.outside_rng.gammavariate(shape, 1.0 / shape)

    def outside_wait_rms(self) -> float:
        """The root mean square of the requests' mean waits outside the engines (before their draws), seconds: the
        scale a draw's spread multiplies (nan: no request sent)."""
        n, squares = self.waits
        return (squares / n) ** 0.5 if n else float("nan")

    def send_busy_share(self) -> float:
        """The cores' mean busy share at the sends (nan: none, or no host_cores; a request the router held counts
        again at its release, the share its delay is taken at)."""
        total, n = self.send_busy
        return total / n if n else float("nan")

    def _unhold(self, flight: _Flight) -> None:
        self._forward(self.now, flight)

    def _forward(self, at_router: float, flight: _Flight) -> None:
        """The router lets the request go to its worker: it arrives after the time outside the engines, once that
        worker's front end has tokenized it."""
        at_server = at_router + self.outside() + self.net
        req = flight.req
        req.arrival_time = self.frontends[flight.worker].tokenize(at_server, len(req.prompt_ids))
        self.push(req.arrival_time, ARRIVE, flight.worker, flight)

    def _receive(self, now: float, flight: _Flight) -> None:
        """The finished request's last token reached the client."""
        del self.flights[flight.req.rid]
        req, s, k = flight.req, flight.session, flight.turn
        times = flight.times
        self.records.append(RequestRecord(
            ok=True, prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, ttft_s=req.first_token_time + 2 * self.net - flight.send_s,
            e2e_s=now - flight.send_s, worker=flight.worker, send_s=flight.send_s, session=s.sid, turn=k,
            itl_s=[b - a for a, b in zip(times, times[1:])], **route_fields(flight.attempt.decision),
            kv_transfer_bytes=req.kv_transfer_bytes, kv_transfer_s=req.kv_transfer_s,
            engine_ttft_s=req.engine_ttft_s))
        self.end = max(self.end, now)
        self.bar.update(1)
        if k + 1 < len(s.turns):
            self.answers[s.sid].append(self.tokenizer.decode(req.output_ids))
            self.push(now + s.turns[k + 1].think_time_s, CLIENT, "due", s, k + 1)
        else:
            del self.answers[s.sid]                        # the conversation is over

    def _fail(self, now: float, flight: _Flight, error: str) -> None:
        del self.flights[flight.req.rid]
        self.router.done(flight.attempt, now + self.net, ok=False)
        s, k = flight.session, flight.turn
        self.records.append(RequestRecord(ok=False, prompt_tokens=len(flight.req.prompt_ids), error=error,
                                          worker=flight.worker, send_s=flight.send_s, session=s.sid, turn=k))
        self.records += not_sent(s, k, flight.send_s)      # its session ends: framework/load/sessions.py's rule
        self.bar.update(len(s.turns) - k)
        self.answers.pop(s.sid, None)
        self.push(now + 2 * self.net, CLIENT, "fail")

    # -- the instances ------------------------------------------------------------------------------------------
    def _arrive(self, now: float, worker: str, flight: _Flight) -> None:
        st = self.state[worker]
        if st.ends is not None:              # cut the run after the step the arrival falls in; queue it then
            st.held.append(flight)
            m = bisect_left([st.run_start] + st.ends[:-1], now)
            if m < len(st.ends):
                st.ends, st.times, st.priced = st.ends[:m], st.times[:m], st.priced[:m]
                st.version += 1
                self.push(st.ends[-1], STEP, worker, st.version)
            return
        self._queue(now, worker, flight)
        if st.busy or st.starting:
            return
        if self.batch_arrivals:
            st.starting = True
            self.push(now, START, worker)
        else:
            self._start(now, worker)

    def _queue(self, now: float, worker: str, flight: _Flight) -> None:
        if self.pd is not None and self.pd.lands(now, worker, flight):   # its KV landed: it joins the running batch
            return
        try:
            if flight.req.pairing is not None:
                self.instances[worker].add_paired(flight.req)
                return
            self.instances[worker].add(flight.req, dp_rank_of(flight.attempt.decision))   # router.dp_aware: its pin
        except ValueError as e:
            self._fail(now, flight, str(e))

    def _busy(self) -> float:
        """The processes busy on the host now."""
        return self.busy_ranks + (self.side_procs if self.flights else 0) + self.background

    def _speed(self, worker: str, kind: str, busy: float) -> float:
        """A step of ``kind`` (a STEP_CPU_KEYS key) on ``worker``, with ``busy`` processes busy: its speed against its
        price (the cores' share, and the contention now over the contention at its own ranks when it was priced)."""
        c, size = self.contention[kind], self.instances[worker].size
        share = min(1.0, self.cores / busy) if busy > 0 else 1.0
        all_up = self.core_up ** min(size, self.cores)   # steal: its ranks advance only while all their cores run
        at = self.contention_at
        return share * all_up * slowdown(c, size, at) / slowdown(c, busy, at)

    def _stretch(self, worker: str, kind: str, busy: float) -> float:
        """sharing=at_start: a step of ``kind`` on ``worker`` keeps the stretch of the busy processes at its start."""
        return 1.0 / self._speed(worker, kind, busy) if self.cores else 1.0

    def _reshare(self, now: float) -> None:
        """host_sharing=fair, after each event: when the busy processes changed, every step in flight has run at the
        old speed until now and runs at the new one from here (its end event moves)."""
        busy = self._busy()
        if busy == self.shared_busy:
            return
        self.shared_busy = busy
        for worker, st in self.state.items():
            if st.busy and st.left > 0:
                speed = self._speed(worker, st.kind, busy)
                if speed == st.speed:
                    continue
                st.left = max(st.left - (now - st.since) * st.speed, 0.0)
                st.since, st.speed = now, speed
                st.version += 1
                self.push(now + st.left / speed, STEP, worker, st.version)

    def _start(self, now: float, worker: str) -> None:
        inst, st = self.instances[worker], self.state[worker]
        if not st.busy:
            self.busy_ranks += inst.size
        st.busy = True
        busy = self._busy()
        k = min(inst.run_ahead(), MAX_RUN) if self.ff else 0
        if k >= 2:
            st.priced, host = inst.run_times(k), inst.run_host_s()
            stretch = self._stretch(worker, "decode_cpu_s", busy)     # a run: decode steps
            st.times = [(t + host) * stretch for t in st.priced]
            st.run_start, st.ends = now, list(accumulate(st.times, initial=now))[1:]   # as steps one by one add up
            self.push(st.ends[-1], STEP, worker, st.version)
            return
        st.ends = None
        d = inst.start_step()
        if self.pd is not None:                   # a decode instance may have pre-allocated a request's slots
            self.pd.started(now, worker, d)
        if d is None:
            st.busy = False
            self.busy_ranks -= inst.size
            return
        kind = inst.step_kind
        if self.fair:                             # at the sharing last set; _reshare moves it if the sharing changes
            st.left, st.since, st.kind = d, now, kind
            st.speed = self._speed(worker, kind, self.shared_busy)
            self.push(now + d / st.speed, STEP, worker, st.version)
            return
        self.push(now + d * self._stretch(worker, kind, busy), STEP, worker, st.version)

    def kick(self, now: float, worker: str) -> None:
        """Something freed room on an idle instance (a transfer let a prefill's KV go): let it step."""
        if not self.state[worker].busy:
            self._start(now, worker)

    def _start_after_arrivals(self, now: float, worker: str) -> None:
        """batch_arrivals: this instant's arrivals are in; the idle instance starts with all of them."""
        self.state[worker].starting = False
        self.kick(now, worker)

    def _step(self, now: float, worker: str, version: int) -> None:
        inst, st = self.instances[worker], self.state[worker]
        if version != st.version:
            return                                        # a run that an arrival cut short
        st.left = 0.0
        if st.ends is not None:
            out = inst.advance(len(st.ends), st.priced, now)
            ends = st.ends
        else:
            out = inst.finish_step(now)
            ends = [now]
        for req, written in zip(out, self.frontends[worker].stream(ends, out)):   # chunks out, one by one
            if self.pd is not None and self.pd.prefilled(now, worker, req):   # a prefill half: its KV is sent
                continue
            flight = self.flights[req.rid]
            if flight.tell_first:                          # its first token: the prompt phase ended here
                flight.tell_first = False
                self.router.first_token(flight.attempt, written + self.net)
            if self.itl:
                flight.times += ends                       # a step gives each request one token, a run one per step
            if req.finished:
                self.router.done(flight.attempt, written + self.net, usage=usage_of(req))
                self.push(written + 2 * self.net, CLIENT, "done", flight)
        held, st.held = st.held, []
        for flight in held:
            self._queue(now, worker, flight)
        self._start(now, worker)
