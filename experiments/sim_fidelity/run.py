"""Sim vs real on this machine: the same workloads, seeds and configs run for real and in `mode=sim` with the
calibrated cost model (data/calibration/cpu.json, or --profile: a profile taken on this host's CPU, from
experiments/calibrate), and the error of each figure.

- router ablation at 4 instances: experiments/router_ablation/run.py runs for real (its own CLI: servelab's router,
  the policies below, both workloads); each of its runs is then simulated with the overrides it recorded.
- TP vs DP attention at size 2: experiments/dp_attn_vs_tp's harness (`bench`, its config.yaml: decode-heavy, one
  in-process instance, kv_budget sizing) runs each scheme for real; the simulation uses the same overrides, with no
  network or router (the in-process driver has none).

The real runs share 2 CPU cores (and the machine with other work), so the simulation models the host
(`sim.host_cores=2`: a step stretches when more ranks are busy than there are cores). Real and simulated repeats are
interleaved (repeat k: the real runs, then their simulations with the background load measured during them), and
each cell is judged against its real runs' own spread (issue 19, item 9): every simulated median must lie inside the
real repeats' range [min, max] for output throughput, TTFT p50 and the cache hit rate; a median outside is flagged.
The older targets (within 10% on throughput and TTFT p50, 0.02 on the hit rate, of the real median) are printed too,
and so are, per figure, the real repeats below the simulated median (0 or n: outside; the same count round after round:
a bias) and the chance a simulator with no bias has of passing at this many repeats (1 - 2^(1-n) per figure: judge on
7 or more; at 3, every varying figure at once passes 1 time in 100).
The host's load average is recorded beside the table. Prints the table, writes results.json and sim_vs_real.png
beside this file (or --out).

    nice -n 5 python experiments/sim_fidelity/run.py --repeats 3   # ~7 minutes on the shared 2-core CPU
    python experiments/sim_fidelity/run.py --quick                 # small and fast (the smoke test)
    python experiments/sim_fidelity/run.py --resimulate experiments/sim_fidelity/results.json \
        --answers printable measured                               # its real runs simulated again, no real run

`--answers` is `sim.answers` (framework/sim/answers.py: printable ASCII answers, or the real engine's measured ones,
the default since the round of experiments/sim_fidelity/protocol_host.md). `--point median --sharing fair --serving
measured` (each profiled point's median, fair sharing of the cores, the HTTP worker's serving CPU) are the defaults
since the round of protocol_sharing.md (judged 485aa0c); `--point fastest --sharing at_start --serving none` simulate
as the rounds before it.
`--contention measured` (the round of protocol_contention.md) measures, before the first real run, how much slower
this host's cores run when all are busy than alone (framework/core/host_probe.contention: the probe's work pinned to
each core alone, then to all at once) and simulates with it (`sim.host_contention`); `none` (the default): 1, as the
rounds before; a number: that factor; `engine` (the round of protocol_engine_contention.md) measures it on the engine's
own steps, per kind (experiments/calibrate/contention.py: extend and decode steps alone, then beside another busy
engine), before the first real run: `sim.host_contention_extend` and `sim.host_contention`.
`--contention block` measures it around each real block instead, with the host's speed (host_probe.Cores: each core
alone, then all at once, PINNED_S each, before and after the block), and simulates the block with the mean: the
contention wanders by the hour (1.12 before round G's run, 1.32 after).
`--collectives block` prices the waits of a two-rank instance's steps on its collectives (split off by
experiments/calibrate) at one all-reduce's latency measured around each real block (host_probe.Cores, with its speed;
`sim.cost.collective_s`); `none` (the default): at the profile's own. `--level-waits scaled` (round Q,
protocol_round_q.md) scales the profile's latency with the block's host scale (`sim.cost.host_scale_waits`): with
`--host-scale level` a two-rank level then scales the whole step, where at the profile's latency DP x2's floored.
`--host-scale pinned` (the round of protocol_pinned.md) takes the host's speed around each real block
(framework/core/host_probe: the probe's work on each core in turn, 1 s each, before and after the block, on the idle
host; `pinned` in this process until 2e3a2ac, `Cores`' pinned processes since) and simulates the block with every
calibrated second scaled by their mean over the profile's reference (`host_probe.pinned_s`; `sim.cost.host_scale`);
`none` (the default) prices the profile's seconds as they are. The scale comes from the probe alone, never from a
real run's figures or CPU.
`--host-scale engine` (the round of protocol_engine_probe.md) takes the host's speed the same way with the engine's own
steps: experiments/calibrate/engine_probe's fixed mix on a one-rank engine kept idle in this process, before and after
each block, over the profile's mean of the same mix (a profile taken with `calibrate/run.py --engine-probe`). On this
AMD EPYC VM host_probe's work correlated 0.09 with the engine's speed in the seconds after it, the engine's mix 0.51
(experiments/calibrate/probe_tracking.py). The profile's points are at that mean by the readings before each
(`calibrate/run.py --normalize engine`, the round of protocol_engine_level.md); round K's was kept as measured.
`--contention engine --contention-siblings 3 --contention-clock cpu` measures the engines' slowing per step kind in the
HTTP cells' shape (4 engines on 2 cores) on their threads' CPU clock, the cores' sharing left to the simulator;
`--contention-busy measured` applies it as measured, growing up to the siblings + 1 busy processes
(`sim.host_contention_busy`; `cores`, the default: in full once every core is busy, as every round before).
`--host-scale level` (the round of protocol_level.md) reads each cell's level in its own shape and hour: before each
repeat's judged runs, a level block runs the same cells on the same workers with another draw of their workloads
(`workload.seed` 1000 + the repeat; the judged runs draw seed 0), and each judged cell is simulated at the level read
from its own (``read_level``): for a one-rank instance, per step kind, its engines' step CPU over the simulated price
(`sim.cost.host_scale_extend`, `sim.cost.host_scale`); for an instance of several ranks, whose waits on collectives
the CPU clock does not count, the scale at which the block's simulation lasts as long as it did. The profile then
gives only the shape of the costs. Not with a contention factor: the CPU clock holds the cores' contention. The
level table also prints, per cell, what its judged runs would themselves have needed read the same way
(``needed_level``): the level's own error, the host's drift between block and judged run and the draw.
`--level-blocks before after` runs a second level block just after each judged block (`workload.seed` 2000 + the
repeat) and reads each cell's level from both, pooled (their seconds summed): the host's drift on either side of the
judged run averaged, and no side always first. On round M's stored runs, pairing each block with the next repeat's
(level_diagnostics.py --levels bracket, roundM_amd/preview_bracket.json) left the inside counts at 5/6, 5/6, 5/6.
`--steal lockstep` (the round of protocol_steal.md) takes, of the other work measured during each real block, the
cores' time the hypervisor gave to other guests (/proc/stat's steal; this VM: 0-0.5 cores by the hour) and simulates
it apart (`sim.host_steal`): no process runs on a core while it is taken, so a two-rank instance, whose ranks meet at
every collective, stalls while either of its cores is; `processes` (the default, as every round before): steal counts
as busy processes of other work, which a two-rank instance only shares the cores with.
`--prefix-regime absorbed` (the round of protocol_absorbed.md) prices an extend batch in the form the engine runs it
in: with no cached prefix from the profile's p = 0 column, with any from its cached columns (`sim.cost.prefix_regime`);
`smooth` (the default, as every round before) reads one grid across both.
`--batch-arrivals` (round N, protocol_round_n.md) starts an idle instance once every request of that instant is in
(`sim.batch_arrivals`), as the real engines took turn 0's burst. `--outside level` (round O, protocol_round_o.md; with
`--host-scale level`) delays each HTTP cell's requests into the engines by the time its level blocks' requests spent
outside them (client, router, HTTP hand-off: `ttft_mean_ms - engine_ttft_ms_mean`) beyond their simulations, added
to `sim.router_overhead_s` (``outside_s``); a run before round N kept no such figures of its blocks, and
`--resimulate` fills them in from its --work folder (``fill_outside``), which must be the run's own. `--outside load`
(round P, protocol_round_p.md) reads the same gap as growing with the cores' busy share at each send
(`sim.outside_busy_s`, ``outside_busy_s``; outside_load.py: the real gap 3.0-3.3 ms one request at a time, 8.9-9.6 at
four in flight, 11.2-11.3 at sixteen). `--outside spread` (round R, protocol_round_r.md) keeps load's mean and draws
each request's own time around it (`sim.outside_cv`, ``outside_cv``: a gamma as spread as the level blocks' requests'
times were, their own per-request figures, `outside_sd_ms`; one draw stream per repeat): the real ones are as spread
as an exponential's (CV 0.8-1.0), and at the mean alone the simulated arrivals kept one order every repeat.
`--resimulate` simulates a stored run's real runs again, each with its own measured background (the simulator is
deterministic), with this run's switches (`--between`, `--point`, `--extend`, `--prefix-regime`, `--serving`,
`--sharing`, `--contention`, `--collectives`, `--steal`, `--batch-arrivals`, `--outside`, `--level-waits`) and each
`--answers`, and writes --resim-out.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from framework.config import compose  # noqa: E402
from framework.core.host_probe import Cores, mismatch, pinned, probe  # noqa: E402
from framework.core.paths import git_sha, load_script  # noqa: E402
from framework.core.proc import host_cpu_s  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402
from plugins.cost.calibrated import DEFAULT_PATH  # noqa: E402

tables = load_script("experiments/sim_fidelity/tables.py")      # the medians, ranges, tables and plot it reports

POLICIES = ["round_robin", "cache_aware"]
SCHEMES = ["tp", "dp_attn"]
SIM = ["mode=sim", "sim.cost=calibrated", "sim.host_cores=2"]
PINNED_S = 1.0     # --host-scale pinned: seconds of the probe's work per core before and after each real block


class Background:
    """Other work's busy processes on this host while a block runs: the host's busy CPU (/proc/stat) less this
    process's and its children's (every real run here), over the wall time (``procs``), and of it the cores' time the
    hypervisor gave to other guests (``steal``, in cores). The simulation shares the cores with as many
    (`sim.host_background`): the real runs did. With --steal lockstep the steal is simulated apart (`sim.host_steal`):
    a two-rank instance stalls while either core is taken, where a busy process would only share them."""

    def __enter__(self) -> "Background":
        self.t, self.host, self.own = time.perf_counter(), host_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t
        (busy, steal), (busy0, steal0) = host_cpu_s(), self.host
        self.procs = max(0.0, ((busy - busy0) - (_own_cpu_s() - self.own)) / wall)
        # measured on its own, not cut to ``procs``: the run's own CPU counts its children when they are reaped, so
        # in a block that reaps processes it ran before (an in-process TP/DP run's ranks), ``procs`` reads 0 at times
        self.steal = (steal - steal0) / wall


def _own_cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class HostSpeed:
    """The host around a block, measured before and after it with ``cores`` (host_probe.Cores: PINNED_S each core
    alone, then all at once, and one all-reduce's latency; None: nothing measured): ``record`` (what a run keeps of
    it) and ``simulated`` (what its simulation takes from it, as ``block_host`` derives it)."""

    def __init__(self, cores: Cores | None = None, reference_s: float | None = None, per_block: bool = False,
                 collectives: bool = False, engine=None, by: str = "host_pinned_s") -> None:
        self.cores, self.engine, self.switches = cores, engine, (reference_s, per_block, collectives, by)
        self.taken: list[dict] = []
        self.engine_taken: list[float] = []

    def _take(self) -> None:
        if self.cores is not None:
            self.taken.append(self.cores.measure(PINNED_S))
        if self.engine is not None:
            self.engine_taken.append(self.engine.measure())

    def __enter__(self) -> "HostSpeed":
        self._take()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:                                      # (a block that failed: its error, not a measurement's)
            self._take()

    def record(self) -> dict:
        """Before and after: the speeds alone, the contentions and the collective latencies, and the engine probe's
        step CPU (None: not measured)."""
        taken = self.taken or None
        return {**{k: taken and [m[key] for m in taken] for k, key in (
            ("host_pinned_s", "pinned_s"), ("host_contentions", "contention"), ("host_collective_s", "collective_s"))},
            "host_engine_s": self.engine_taken or None}

    def simulated(self) -> tuple[float, float | None, float | None]:
        return block_host(self.record(), *self.switches)


def block_host(record: dict, reference_s: float | None, per_block: bool, collectives: bool,
               by: str = "host_pinned_s") -> tuple[float, float | None, float | None]:
    """A block's host as its simulation takes it, from what was measured around it (``HostSpeed.record``, or a stored
    run's): the scale, its speeds over the profile's reference speed (1.0 without one: --host-scale none; ``by``:
    which speeds, host_probe's `host_pinned_s` or the engine probe's `host_engine_s`); the
    contention (--contention block; None: the run's switches'); one collective's latency (--collectives block;
    None: the profile's own)."""
    scale = statistics.fmean(record[by]) / reference_s if reference_s else 1.0
    contention = statistics.fmean(record["host_contentions"]) if per_block else None
    latency = record.get("host_collective_s")
    collective = statistics.fmean(latency) if collectives and latency and None not in latency else None
    return scale, contention, collective


def scale_reference(stamp: dict | None, host_scale: str) -> tuple[float | None, str]:
    """--host-scale's reference speed from a profile's host stamp, and which of a block's readings it divides
    (``block_host``'s ``by``): none -> (None, ...): no scale; pinned -> host_probe's, where the profile's points are
    normalized to it; engine -> the engine probe's mean over the profile, where its points are normalized to it
    (calibrate `--normalize engine`), or kept as measured (round K's way, said: each config is then priced at the
    speed it was measured at, which was not the mean; a host_probe-normalized profile would be rescaled twice). Exits,
    saying why, when the profile has no such reference."""
    by = "host_engine_s" if host_scale == "engine" else "host_pinned_s"
    if host_scale in ("none", "level"):                 # (level: each cell's own, read_level)
        return None, by
    from plugins.cost.calibrated import reference_pinned_s
    stamp = stamp or {}
    if host_scale == "pinned":
        reference = reference_pinned_s(stamp)
        fix = ("re-profile with experiments/calibrate/run.py, or make its twin with "
               "experiments/calibrate/renormalize.py from the profile as measured (--normalize none)")
        why = "its points are not normalized to host_probe's speed (host_probe.normalized 'pinned')"
    else:
        reference = stamp.get("engine_s") if stamp.get("normalized") in ("engine", "none") else None
        fix = "re-profile with experiments/calibrate/run.py --engine-probe --normalize engine"
        why = (f"it has no engine probe's speed over points normalized to it or kept as measured "
               f"(host_probe.engine_s, normalized 'engine' or 'none'; this one: engine_s {stamp.get('engine_s')}, "
               f"normalized {stamp.get('normalized')!r})")
        if reference is not None and stamp.get("normalized") == "none":
            print("WARNING: --host-scale engine on a profile kept as measured (round K's way): each config is priced "
                  "at the speed it was measured at, not the profile's mean; normalize it with "
                  "experiments/calibrate/renormalize.py --by engine", flush=True)
    if reference is None:
        sys.exit(f"--host-scale {host_scale}: the calibration profile cannot be scaled so: {why}; {fix}")
    return reference, by


def block_load(record: dict, lockstep: bool) -> tuple[float, float | None]:
    """A block's other work as its simulation takes it, from what was measured during it (``_host``'s record, or a
    stored run's): (busy processes, steal). With --steal lockstep the steal comes off the processes and is simulated
    apart; otherwise it counts among them (steal None)."""
    background = record["host_background"]
    if not lockstep:
        return background, None
    return max(0.0, background - record["host_steal"]), record["host_steal"]


def sim_config(study: str, overrides: list[str], sim_args: list[str], load: tuple[float, float | None],
               host: tuple[float, float | None, float | None] = (1.0, None, None), level: dict | None = None,
               draw: int = 0):
    """The simulated run of a real one: its overrides, mode=sim's, the other work during it (``block_load``; the
    in-process TP/DP driver has no network or router) and the host then (``block_host``: its scale, its contention
    with --contention block, and its collectives' latency with --collectives block; ``sim_args`` carry none then), or
    with --host-scale level its cell's level by step kind (``read_level``), which replaces the scale; with --outside
    spread, its requests' times outside the engines drawn from the stream ``draw`` (the repeat)."""
    background, steal = load
    host_scale, contention, collective = leveled(host, level)
    local = ["sim.network_latency_s=0", "sim.router_overhead_s=0"] if study == "dp_attn_vs_tp" else []
    block = [] if contention is None else [f"sim.host_contention={contention:.4f}",
                                           f"sim.host_contention_extend={contention:.4f}"]
    block += [] if level is None else [f"sim.cost.host_scale_extend={level['extend']:.4f}"]
    block += [] if collective is None else [f"sim.cost.collective_s={collective:.6f}"]
    block += [] if steal is None else [f"sim.host_steal={steal:.3f}"]
    cfg = compose(overrides + sim_args + local + block + [f"sim.host_background={background:.3f}",
                                                           f"sim.cost.host_scale={host_scale:.4f}"])
    if level is not None and "outside_s" in level:     # --outside level: later into the engines than the router's own
        router_s = cfg.sim.router_overhead_s + level["outside_s"]
        if router_s < 0:
            print(f"WARNING: --outside level: {level['outside_s'] * 1e3:.1f} ms outside the engines takes the router's "
                  f"time below 0; 0 simulated", flush=True)
        cfg.sim.router_overhead_s = max(0.0, router_s)
    if level is not None and "outside_busy_s" in level:   # --outside load: later the busier the cores at the send
        cfg.sim.outside_busy_s = level["outside_busy_s"]
    if level is not None and "outside_cv" in level:       # --outside spread: each request's own draw around it
        cfg.sim.outside_cv, cfg.sim.outside_seed = level["outside_cv"], draw
    return cfg


def leveled(host: tuple[float, float | None, float | None], level: dict | None) -> tuple:
    """A block's host as simulated: ``block_host``'s, its scale replaced by a level's (read_level) where there is one:
    `sim.cost.host_scale` is the decode steps' level (and the serving's), `host_scale_extend` the extends'."""
    return host if level is None else (level["decode"], *host[1:])


def _host(background: "Background", speed: HostSpeed) -> dict:
    """A case's record of the host during its real run (``host_scale``: as simulated)."""
    return {"host_background": background.procs, "host_steal": background.steal, "host_scale": speed.simulated()[0],
            **speed.record()}


LEVEL_SEEDS = {"before": 1000, "after": 2000}   # --host-scale level: repeat k's level blocks draw workload.seed
# LEVEL_SEEDS[which] + k (the judged runs: seed 0); --level-blocks says which run (round M: before; round N: both)
OUTSIDE_KEYS = tables.SPLIT    # the client's mean TTFT and its part in the engines: --outside level (round N on)
SPREAD_KEYS = ("outside_mean_ms", "outside_sd_ms")   # the requests' times outside the engines: --outside spread
LEVEL_KEEP = ("extend_cpu_s", "decode_cpu_s", "duration_s") + OUTSIDE_KEYS + SPREAD_KEYS   # what read_level takes
# from a level block's real run
MIN_LEVEL = 0.05       # read_level's floor (said when reached)


def read_level(case: str, study: str, sim_args: list[str], blocks: list[tuple[list[str], tuple, dict]],
               outside: str = "none", collectives: list[float | None] | None = None) -> dict:
    """--host-scale level: a cell's level by step kind, read from its level blocks (the same cell at other seeds, run
    just before the judged one, and with --level-blocks both just after it too: the host's speed in the cell's own
    shape and hour, from runs that are not judged), each block ``(overrides, load, real figures)``, against the
    blocks' simulations at the profile's own level, pooled (the blocks' seconds summed: two blocks are read as one).
    A one-rank instance: the engines' step CPU over the simulated price, per kind (a one-rank profile's points were
    timed alone, where wall and CPU agree; the CPU clock leaves the cores' sharing to the simulator and holds the
    cores' contention, so none is simulated on top). An instance of several ranks waits at every step on collectives
    that its ranks' CPU clock does not count: one scale for both kinds, the one at which the blocks' simulations last
    as long as the real blocks did (each duration taken as linear in the scale, between simulations at 1 and 2). A
    level below MIN_LEVEL is said and floored there. With ``outside`` (--outside level), an HTTP cell's level also
    holds `outside_s`: the seconds its blocks' requests spent outside the engines (client, router, HTTP hand-off:
    ttft_mean_ms - engine_ttft_ms_mean) beyond what their simulations spend there, mean over the blocks; sim_config
    adds them to the router's time, before the engine (a request in transit holds no KV). With --outside load, it
    holds `outside_busy_s` instead: the wait with every core busy at which the blocks' simulations at the level read
    spend as long outside the engines as the real blocks (sim.outside_busy_s: the gap grows with the busy cores).
    With --outside spread, also `outside_cv`: how spread each request's own time is around that (``outside_cv``).
    ``collectives`` (--collectives block, round Q): one collective's latency measured around each block (None where
    none was), at which an instance of several ranks is simulated there, as its judged block is at its own; without
    it, the profile's own."""
    given = collectives is not None
    collectives = collectives if given else [None] * len(blocks)
    cfgs = [sim_config(study, overrides, sim_args, load, (1.0, None, c))
            for (overrides, load, _), c in zip(blocks, collectives)]
    if given and cfgs[0].parallel.size > 1 and None in collectives:   # (one rank waits on no collective)
        raise ValueError(f"--collectives block: {case}'s level blocks took no collective latency around them (a run "
                         f"before round Q); give --collectives none")
    at_one = [simulate(cfg)[0] for cfg in cfgs]
    reals = [real for _, _, real in blocks]
    if cfgs[0].parallel.size == 1:
        level = {"by": "step_cpu"}
        for kind, key in (("extend", "extend_cpu_s"), ("decode", "decode_cpu_s")):
            real, priced = [r.get(key) for r in reals], sum(s[key] for s in at_one)
            if None in real or not priced > 0:
                raise ValueError(f"--host-scale level: {case}'s level block has no {kind} steps to read a level from "
                                 f"(real {real} s, priced {priced} s): a workload too small for it")
            level[kind] = _floored(case, kind, sum(real) / priced, f"its engines' {kind} CPU {sum(real):.2f} s "
                                   f"against a price of {priced:.2f} s")
        if outside == "level" and cfgs[0].cluster.http:   # (the in-process TP/DP driver has no client or router)
            level["outside_s"] = outside_s(case, reals, at_one)
        elif outside in ("load", "spread") and cfgs[0].cluster.http:
            level["outside_busy_s"], sims = outside_busy_s(case, study, sim_args, blocks, level)
            if outside == "spread":
                level["outside_cv"] = outside_cv(case, reals, sims)
        return level
    at_two = [simulate(sim_config(study, overrides, sim_args, load, (2.0, None, c)))[0]
              for (overrides, load, _), c in zip(blocks, collectives)]
    one, two = sum(s["duration_s"] for s in at_one), sum(s["duration_s"] for s in at_two)
    real = sum(r["duration_s"] for r in reals)
    if not two > one:
        raise ValueError(f"--host-scale level: {case}: the simulated duration does not grow with the host's scale "
                         f"({one:.2f} s at 1, {two:.2f} s at 2)")
    scale = _floored(case, "step", 1.0 + (real - one) / (two - one),
                     f"the real blocks took {real:.2f} s, the part of their simulations that does not scale "
                     f"{2 * one - two:.2f} s")
    return {"by": "duration", "extend": scale, "decode": scale}


def outside_s(case: str, reals: list[dict], sims: list[dict]) -> float:
    """The seconds a request of these blocks spent outside the engines in the real runs beyond their simulations,
    mean over the blocks."""
    missing = [k for r in reals for k in OUTSIDE_KEYS if r.get(k) is None]
    if missing:
        raise ValueError(f"--outside: {case}'s level blocks did not keep {sorted(set(missing))} (a run before "
                         f"round N: give --work, the folder its level blocks' runs wrote to)")
    gaps = [(r["ttft_mean_ms"] - r["engine_ttft_ms_mean"]) - (s["ttft_mean_ms"] - s["engine_ttft_ms_mean"])
            for r, s in zip(reals, sims)]
    return statistics.fmean(gaps) / 1e3


OUTSIDE_TOL_MS = 0.1     # --outside load: how close the blocks' simulated time outside the engines comes to the real


def outside_busy_s(case: str, study: str, sim_args: list[str], blocks: list[tuple[list[str], tuple, dict]],
                   level: dict, rounds: int = 8) -> tuple[float, list[dict]]:
    """sim.outside_busy_s at which these blocks' simulations, at their ``level``, spend as long outside the engines
    as their real runs did (mean over the blocks): solved by the secant from the blocks' gap over the cores' busy
    share at their sends (a later arrival leaves the cores idler at the next sends, so that first reading falls
    short); the closest of the values tried, said when not within OUTSIDE_TOL_MS. Blocks whose simulations already
    spend longer outside than the real runs read 0, said. Returns it with the blocks' simulations at it."""
    reals = [real for _, _, real in blocks]

    def run(busy_s: float) -> list[dict]:
        return [simulate(sim_config(study, overrides, sim_args, load, level={**level, "outside_busy_s": busy_s}))[0]
                for overrides, load, _ in blocks]

    def short_ms(sims: list[dict]) -> float:          # the real gap left over, ms
        return outside_s(case, reals, sims) * 1e3

    sims = run(0.0)
    x0, y0 = 0.0, short_ms(sims)
    if y0 <= 0:
        print(f"WARNING: --outside load: {case}'s level blocks' simulations spend {-y0:.2f} ms longer outside the "
              f"engines than the real blocks with none added; 0 simulated", flush=True)
        return 0.0, sims
    share = statistics.fmean(s["sim_send_busy_share"] for s in sims)
    if not share > 0.05:                               # (nan: no sim.host_cores)
        raise ValueError(f"--outside load: {case}'s level blocks kept the cores {share:.3f} busy at the sends in their "
                         f"simulations: too idle to read a wait for busy cores from")
    best, x1 = (y0, x0, sims), y0 / 1e3 / share
    for _ in range(rounds):
        sims = run(x1)
        y1 = short_ms(sims)
        best = min(best, (abs(y1), x1, sims), key=lambda b: b[:2])
        if abs(y1) < OUTSIDE_TOL_MS or y1 == y0:
            break
        x0, y0, x1 = x1, y1, max(0.0, x1 - y1 * (x1 - x0) / (y1 - y0))
    left, busy_s, sims = best
    if left >= OUTSIDE_TOL_MS:
        print(f"WARNING: --outside load: {case}'s sim.outside_busy_s {busy_s * 1e3:.1f} ms, the closest of those "
              f"tried, leaves {left:.2f} ms of its blocks' time outside the engines unmatched", flush=True)
    return busy_s, sims


def outside_cv(case: str, reals: list[dict], sims: list[dict]) -> float:
    """sim.outside_cv at which these blocks' simulations (``sims``, at their level and mean wait outside the engines:
    ``outside_busy_s``'s) spread their requests' times outside the engines as much as the real runs did: the real variance (per
    request, within a run; mean over the blocks) less the simulated one (the busy share's own swing at the sends),
    over the mean square of the simulated waits a draw multiplies (`sim_outside_wait_rms_ms`: a draw g of mean 1,
    independent of the wait m, adds E[m^2] Var(g) to the variance). Blocks whose simulations already spread as much
    read 0, said."""
    if any(not math.isfinite(r.get("outside_sd_ms") or math.nan) for r in reals):
        raise ValueError(f"--outside spread: {case}'s level blocks did not keep a spread of their requests' times "
                         f"outside the engines (outside_sd_ms: reported since round R, by a worker that reports "
                         f"meta_info.engine_ttft_s, over 2 requests or more): give --outside load")
    real_var = statistics.fmean(r["outside_sd_ms"] ** 2 for r in reals)
    sim_var = statistics.fmean(s["outside_sd_ms"] ** 2 for s in sims)
    square = statistics.fmean(s["sim_outside_wait_rms_ms"] ** 2 for s in sims)
    if real_var <= sim_var or not square > 0:
        print(f"WARNING: --outside spread: {case}'s level blocks' simulations spread their times outside the engines "
              f"(sd {sim_var ** 0.5:.2f} ms) as much as the real blocks ({real_var ** 0.5:.2f} ms) or wait none "
              f"({square ** 0.5:.2f} ms); no draw", flush=True)
        return 0.0
    return ((real_var - sim_var) / square) ** 0.5


def _floored(case: str, kind: str, level: float, why: str) -> float:
    if level < MIN_LEVEL:
        print(f"WARNING: --host-scale level: {case}'s {kind} level reads {level:.3f} ({why}); floored at {MIN_LEVEL}",
              flush=True)
    return max(level, MIN_LEVEL)


def level_block(overrides: list[str], real: dict, measured: dict) -> dict:
    """What a case keeps of a level block: enough for read_level, here and in --resimulate."""
    return {"overrides": overrides, "real": {k: real.get(k) for k in LEVEL_KEEP},
            "host_background": measured["host_background"], "host_steal": measured["host_steal"],
            "host_collective_s": measured.get("host_collective_s")}


def with_level(case: str, blocks: dict, study: str, sim_args: list[str], lockstep: bool,
               outside: str = "none", collectives: bool = False) -> dict | None:
    """A case's level from its level blocks by which (``LEVEL_SEEDS``' keys; the ones present are pooled by
    read_level), None without any (--host-scale other than level); with ``collectives`` (--collectives block) an
    instance of several ranks is simulated there at the collective latency measured around each block."""
    found = [b for b in blocks.values() if b]
    if not found:
        return None
    latency = [block_host(b, None, False, True)[2] for b in found] if collectives else None
    return read_level(case, study, sim_args, [(b["overrides"], block_load(b, lockstep), b["real"]) for b in found],
                      outside, latency)


def _block_key(which: str) -> str:
    """Where a case stores its level block by which: `level_block` (the one before, as round M stored it), or
    `level_block_<which>`."""
    return "level_block" if which == "before" else f"level_block_{which}"


def stored_blocks(run: dict, which: list[str]) -> dict:
    """A stored case's level blocks by which, of those asked for."""
    return {w: run.get(_block_key(w)) for w in which}


def _level_record(blocks: dict, level: dict | None, host: tuple, needed: dict | None = None) -> dict:
    """A case's record of its level (nothing without one): its blocks (``_block_key``), the level read from them,
    the scale it was simulated with (``leveled``: the block's host otherwise), and the level its judged run would
    have needed (``needed_level``)."""
    if level is None:
        return {}
    return {**{_block_key(w): b for w, b in blocks.items()}, "host_level": level,
            "host_scale": leveled(host, level)[0], "level_needed": needed}


def needed_level(level: dict | None, case: str, study: str, overrides: list[str], real: dict, measured: dict,
                 sim_args: list[str], lockstep: bool, collectives: bool = False) -> dict | None:
    """With a ``level`` (None: none), the level its judged run would have needed: read_level's reading of the judged
    run itself, as of a block (not simulated with; reported beside the level its blocks read, where the difference is
    the level's own error: the host's drift between them and the draw)."""
    return level and with_level(case, {"judged": level_block(overrides, real, measured)}, study, sim_args, lockstep,
                                collectives=collectives)


def _router_block(quick: bool, out: Path, host, extra: list[str] = ()) -> tuple[list[tuple[str, list, dict]], dict,
                                                                                    HostSpeed]:
    """One run of experiments/router_ablation: its trials as (case, overrides, figures), the host during it, its
    speed."""
    cmd = [sys.executable, str(ROOT / "experiments/router_ablation/run.py"), "--impls", "servelab", "--policies",
           *POLICIES, "--out", str(out / "router_ablation")] + (["--quick"] if quick else []) \
        + (["--overrides", *extra] if extra else [])
    with host() as speed, Background() as background:
        subprocess.run(cmd, check=True, cwd=ROOT)
    return router_trials(out / "router_ablation" / "results.json"), _host(background, speed), speed


def router_trials(path: Path) -> list[tuple[str, list[str], dict]]:
    """A router_ablation results.json's trials as (case, overrides, figures): the case its workload/router, the
    overrides that run it."""
    real = json.loads(path.read_text())
    return [(f"{t['workload']}/{t['router']}", real["overrides"][t["workload"]] + [f"router={t['router']}"], t)
            for t in real["trials"]]


def router_cases(quick: bool, out: Path, sim_args: list[str], host=HostSpeed, lockstep: bool = False,
                 level_seeds: dict | None = None, outside: str = "none", draw: int = 0) -> list[dict]:
    """Real runs by experiments/router_ablation, then each simulated; with ``level_seeds`` (--host-scale level: a
    seed by which block, ``LEVEL_SEEDS``' keys), level blocks around them: the same cells at those seeds, before the
    judged runs and after them, each cell simulated at the level read from its own (``draw``: sim_config's)."""
    seeds = level_seeds or {}

    def block(which: str) -> dict:        # a level block's cases, each kept as read_level takes it
        block_trials, block_measured, _ = _router_block(quick, _level_dir(out, which), HostSpeed,
                                                        [f"workload.seed={seeds[which]}"])
        return {case: level_block(overrides, real, block_measured) for case, overrides, real in block_trials}
    blocks = {"before": block("before")} if "before" in seeds else {}
    trials, measured, speed = _router_block(quick, out, host)
    blocks |= {"after": block("after")} if "after" in seeds else {}
    cases = []
    for case, overrides, trial in trials:
        own = {which: by_case[case] for which, by_case in blocks.items()}
        level = with_level(case, own, "router_ablation", sim_args, lockstep, outside)
        sim, _ = simulate(sim_config("router_ablation", overrides, sim_args, block_load(measured, lockstep),
                                     speed.simulated(), level, draw))
        needed = needed_level(level, case, "router_ablation", overrides, trial, measured, sim_args, lockstep)
        cases.append({"case": case, "study": "router_ablation", "overrides": overrides, "real": trial, "sim": sim,
                      **measured, **_level_record(own, level, speed.simulated(), needed)})
    return cases


def _level_dir(out: Path, which: str) -> Path:
    """Where a level block's real runs write: `level` before the judged runs (as round M's), `level_after` after."""
    return out / ("level" if which == "before" else f"level_{which}")


def _scheme_block(bench, overrides: list[str], out: Path, host) -> tuple[dict, dict, HostSpeed]:
    """One run of experiments/dp_attn_vs_tp's harness: its figures, the host during it, its speed."""
    with contextlib.redirect_stdout(io.StringIO()), host() as speed, Background() as background:
        real = bench(overrides, out)
    return real, _host(background, speed), speed


def scheme_cases(quick: bool, out: Path, sim_args: list[str], host=HostSpeed, lockstep: bool = False,
                 level_seeds: dict | None = None, collectives: bool = False) -> list[dict]:
    """Real runs by experiments/dp_attn_vs_tp's harness at size 2 (kv_budget sizing), then each simulated; with
    ``level_seeds``, each scheme's level blocks around its judged run (router_cases), each measured as the judged
    run is (``host``: with ``collectives``, its collective latency, at which the blocks are simulated)."""
    bench = load_script("experiments/dp_attn_vs_tp/run.py").bench      # (not a bare `run`: calibrate's may be loaded)
    plan = OmegaConf.to_container(OmegaConf.load(ROOT / "experiments/dp_attn_vs_tp/config.yaml"))
    base = plan["overrides"] + (plan["tiny"]["overrides"] if quick else []) + plan["sizings"]["kv_budget"]
    cases = []
    for scheme in SCHEMES:
        overrides, case = base + plan["schemes"][scheme] + ["parallel.size=2"], f"{scheme}x2"

        def block(which: str) -> dict:
            seeded = overrides + [f"workload.seed={level_seeds[which]}"]
            real, measured, _ = _scheme_block(bench, seeded, _level_dir(out, which) / "dp_attn_vs_tp" / scheme,
                                              host)
            return level_block(seeded, real, measured)
        seeds = level_seeds or {}
        blocks = {"before": block("before")} if "before" in seeds else {}
        real, measured, speed = _scheme_block(bench, overrides, out / "dp_attn_vs_tp" / scheme, host)
        blocks |= {"after": block("after")} if "after" in seeds else {}
        level = with_level(case, blocks, "dp_attn_vs_tp", sim_args, lockstep, collectives=collectives)
        sim, _ = simulate(sim_config("dp_attn_vs_tp", overrides, sim_args, block_load(measured, lockstep),
                                     speed.simulated(), level))
        cases.append({"case": case, "study": "dp_attn_vs_tp", "overrides": overrides, "real": real,
                      "sim": sim, **measured, **_level_record(blocks, level, speed.simulated(), needed_level(
                          level, case, "dp_attn_vs_tp", overrides, real, measured, sim_args, lockstep,
                          collectives))})
    return cases


def host_check(profile: str) -> dict:
    """The calibration profile's host stamp against this host now: simulated seconds compare with real ones only
    when they match (the profile prices steps in its host's seconds)."""
    from plugins.cost.calibrated import read_calibration, reference_pinned_s
    stamp = read_calibration(profile).get("host_probe")
    now = probe()
    if stamp and stamp.get("pinned_s"):          # the profile's reference speed: compared pinned, as it was taken
        now["pinned_s"] = pinned(PINNED_S)
    problems = mismatch(stamp, now)
    for p in problems:
        print(f"WARNING: the calibration profile ({profile}) may not describe this host: {p}", flush=True)
    return {"profile": stamp, "now": now, "problems": problems, "reference_s": reference_pinned_s(stamp)}


def host_line(host: dict) -> str:
    return ("calibration profile's host: matches this host (CPU model, cache where stamped, cores, probe within 25%)"
            if not host["problems"]
            else "calibration profile's host: " + "; ".join(host["problems"]))


KEEP = [k for k, _ in tables.FIGURES] + list(tables.EXTRA) + list(tables.WORK) \
    + ["duration_s", "steps", "retractions", "sim_wall_s", tables.BY_TURN]     # each run's figures in results.json


def resimulate(stored: dict, sim_args: list[str], reference_s: float | None = None, per_block: bool = False,
               collectives: bool = False, lockstep: bool = False, blocks: bool = False,
               by: str = "host_pinned_s", level_blocks: list[str] = (),
               blocks_of=None, outside: str = "none") -> tuple[list[dict], str]:
    """A stored run's real runs simulated again with `sim_args`, each with the background measured during it: the
    cells (as `tables.combine` makes them) and their range table. ``reference_s`` (--host-scale pinned): each block's
    speeds over the reference speed of the profile simulated with now (a profile measured since the run has its own);
    ``per_block`` / ``collectives``: the contention / collective latency measured around each block; ``blocks``: the
    table also lists every block's throughput, real and simulated, beside its steal; ``level_blocks`` (--host-scale
    level: --level-blocks' names): each case at the level read again from those of its stored level blocks with
    `sim_args`; ``blocks_of(k, run)``, in their place: the blocks a level is read from for repeat k's run
    (level_diagnostics.py: another repeat's, or the judged run itself)."""
    meta = {c["case"]: c for c in stored["cases"]}
    repeats = []
    for k, rep in enumerate(stored["runs"]):
        cases = []
        for run in rep:
            c = meta[run["case"]]
            host = block_host(run, reference_s, per_block, collectives, by)
            blocks = stored_blocks(run, level_blocks) if blocks_of is None else blocks_of(k, run)
            own = with_level(run["case"], blocks, c["study"], sim_args, lockstep, outside, collectives)
            sim, _ = simulate(sim_config(c["study"], c["overrides"], sim_args, block_load(run, lockstep), host, own,
                                         draw=k))
            needed = needed_level(own, run["case"], c["study"], c["overrides"], run["real"], run, sim_args, lockstep,
                                  collectives)
            cases.append({"case": run["case"], "study": c["study"], "overrides": c["overrides"], "real": run["real"],
                          "sim": {k: sim.get(k) for k in KEEP}, "host_background": run["host_background"],
                          "host_steal": run.get("host_steal"), "host_scale": host[0],
                          **_level_record(blocks, own, host, needed)})
        repeats.append(cases)
    cells = tables.combine(repeats)
    for c in cells:
        c["errors"] = tables.errors(c)
    text = tables.range_table(cells, stored["load_average"])
    return cells, text + "\n\n" + tables.block_table(repeats) if blocks else text


def parser() -> argparse.ArgumentParser:
    """The command line (also outside_load.py's: the same switches simulate its runs)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads: the smoke test")
    ap.add_argument("--studies", nargs="+", default=["router_ablation", "dp_attn_vs_tp"],
                    choices=["router_ablation", "dp_attn_vs_tp"])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "sim_fidelity",
                    help="where the real runs write their own results")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved real + simulated repeats per cell")
    ap.add_argument("--profile", default=None,
                    help="sim.cost.path: the calibration profile (experiments/calibrate/run.py --out; relative to the "
                         f"repository), taken on this host's CPU (a mismatch is warned); default {DEFAULT_PATH}, or "
                         "with --resimulate the stored run's")
    ap.add_argument("--between", choices=["fit", "grid"], default="grid",
                    help="sim.cost.between: the calibrated profile's fit, or its measured points (plugins/cost/calibrated.py)")
    ap.add_argument("--point", choices=["fastest", "median"], default="median",
                    help="sim.cost.point: each profiled point's fastest or median repeat (plugins/cost/calibrated.py)")
    ap.add_argument("--extend", choices=["batch", "per_request"], default="batch",
                    help="sim.cost.extend: a multi-request extend batch priced as one request or per request")
    ap.add_argument("--prefix-regime", choices=["smooth", "absorbed"], default="smooth",
                    help="sim.cost.prefix_regime: one grid across every prefix, or an extend priced from the profile's "
                         "p = 0 column or its cached columns, as the engine runs it (plugins/cost/calibrated.py)")
    ap.add_argument("--outside", choices=["none", "level", "load", "spread"], default="none",
                    help="level (with --host-scale level): each HTTP cell's requests reach the engines later by the "
                         "time its level blocks spent outside them beyond their simulations (read_level's outside_s); "
                         "load: by that time read as growing with the cores' busy share at the send "
                         "(sim.outside_busy_s, read_level's outside_busy_s; round P); spread: load's, and each "
                         "request's own drawn around it as spread as its level blocks' requests' were "
                         "(sim.outside_cv, read_level's outside_cv, one draw stream per repeat; round R)")
    ap.add_argument("--level-waits", choices=["unscaled", "scaled"], default="unscaled",
                    help="scaled: sim.cost.host_scale_waits=true, a two-rank instance's waits on collectives at the "
                         "profile's latency scale with its host scale (the level, or the probe's) as its compute "
                         "does (round Q); unscaled: at the profile's latency (rounds before)")
    ap.add_argument("--batch-arrivals", action="store_true",
                    help="sim.batch_arrivals=true: an idle instance starts its step once every request arriving at "
                         "that instant is in, as the real engine took turn 0's burst (round N)")
    ap.add_argument("--serving", choices=["none", "measured"], default="measured",
                    help="sim.cost.serving: an HTTP worker's CPU per request outside its steps (calibrate/serving.py)")
    ap.add_argument("--sharing", choices=["at_start", "fair"], default="fair",
                    help="sim.host_sharing: how busy processes share the cores (framework/sim/cluster.py)")
    ap.add_argument("--host-scale", choices=["none", "pinned", "engine", "level"], default="none",
                    help="sim.cost.host_scale: 1, or the host's speed around each real block over the profile's: "
                         "host_probe's (pinned) or the engine's own steps' (engine: experiments/calibrate/"
                         "engine_probe, a profile taken with --engine-probe); or each cell's level by step kind, read "
                         "from a level block run just before it: the same cell at another seed (level: read_level)")
    ap.add_argument("--level-blocks", nargs="+", choices=list(LEVEL_SEEDS), default=["before"],
                    help="--host-scale level: the level blocks each judged block's level is read from, pooled: the one "
                         "just before it (round M's), the one just after it, or both around it (before after); with "
                         "--resimulate: which of the stored run's")
    ap.add_argument("--contention", default="none",
                    help="sim.host_contention: none (1), measured (framework/core/host_probe.contention, before the "
                         "real runs), block (host_probe.Cores around each real block, with its speed), engine "
                         "(experiments/calibrate/contention.py: per step kind), a factor, or two (decode,extend); "
                         "with --resimulate, "
                         "measured, block or engine: the stored run's")
    ap.add_argument("--contention-siblings", type=int, default=1,
                    help="--contention engine: busy sibling engines beside the measured one (1: round F's; 3: the "
                         "HTTP cells' four workers)")
    ap.add_argument("--contention-clock", choices=["wall", "cpu"], default="wall",
                    help="--contention engine: a point's wall time (round F's) or its steps' thread CPU (with more "
                         "engines than cores: the sharing is the simulator's own, calibrate/contention.py)")
    ap.add_argument("--contention-busy", choices=["cores", "measured"], default="cores",
                    help="--contention engine: the busy processes its factors hold (sim.host_contention_busy): the "
                         "cores (every round before), or as measured (the siblings + 1: 4 with --contention-siblings 3; "
                         "the slowing then grows to them)")
    ap.add_argument("--contention-rounds", type=int, default=2,
                    help="--contention engine: alone / beside alternations (calibrate/contention.py --rounds)")
    ap.add_argument("--collectives", choices=["none", "block"], default="none",
                    help="sim.cost.collective_s: the profile's own latency of one collective (none), or the host's "
                         "around each real block (host_probe.Cores; a two-rank profile split its steps' waits off)")
    ap.add_argument("--steal", choices=["processes", "lockstep"], default="processes",
                    help="the cores' time the hypervisor took during each real block (/proc/stat's steal): counted "
                         "as busy processes of other work (processes), or simulated apart (lockstep: sim.host_steal, "
                         "a multi-rank instance stalls while any of its cores is taken)")
    ap.add_argument("--answers", nargs="+", choices=["printable", "measured"], default=["measured"],
                    help="sim.answers (framework/sim/answers.py); several only with --resimulate")
    ap.add_argument("--resimulate", type=Path, help="a stored results.json: simulate its real runs again, run none")
    ap.add_argument("--blocks", action="store_true", help="with --resimulate: every block's throughput, real and "
                                                          "simulated, beside its steal")
    ap.add_argument("--resim-out", type=Path, default=None,
                    help="where --resimulate writes (default: resim_<between>_<answers>.json beside this file)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    if args.contention_busy == "measured" and args.contention != "engine":
        sys.exit(f"--contention-busy measured: only --contention engine measures with a number of busy engines (its "
                 f"siblings + 1); got --contention {args.contention}")
    if args.host_scale == "level" and args.contention != "none":
        sys.exit(f"--host-scale level with --contention {args.contention}: a one-rank level is read on the engines' "
                 f"CPU clock, which holds their cores' contention; give --contention none")
    if args.level_waits == "scaled" and args.collectives == "block":
        sys.exit("--level-waits scaled with --collectives block: the one scales the profile's latency with the host, "
                 "the other measures the host's own, which nothing scales; give one of them")
    if args.outside != "none" and args.host_scale != "level":
        sys.exit(f"--outside {args.outside}: the time outside the engines is read from level blocks, which only "
                 f"--host-scale level runs; got --host-scale {args.host_scale}")
    if args.level_blocks != ["before"] and args.host_scale != "level":
        sys.exit(f"--level-blocks {' '.join(args.level_blocks)}: level blocks are read only with --host-scale level; "
                 f"got --host-scale {args.host_scale}")
    if args.resimulate:
        return resimulate_main(args)
    if len(args.answers) != 1:
        sys.exit(f"--answers: one value for a run, got {args.answers} (several only with --resimulate)")
    import torch
    torch.set_num_threads(1)
    t0 = time.time()
    args.profile = args.profile or DEFAULT_PATH
    host = host_check(args.profile)
    reference_s, by = scale_reference(host["profile"], args.host_scale)
    load = {"before": os.getloadavg(), "cores": os.cpu_count()}
    per_block = args.contention == "block"
    # (--host-scale engine: host_probe's readings are taken around each block all the same, for --resimulate
    # --host-scale pinned on the same runs)
    measured = args.host_scale not in ("none", "level") or args.contention in ("measured", "block") \
        or args.collectives == "block"
    level = args.host_scale == "level"
    if args.host_scale == "engine":
        EngineProbe = load_script("experiments/calibrate/engine_probe.py").EngineProbe
    with Cores() if measured else contextlib.nullcontext() as probes, \
            EngineProbe() if args.host_scale == "engine" else contextlib.nullcontext() as engine:
        in_load = functools.partial(engine_contention, args.contention_siblings, args.contention_clock,
                                    args.contention_rounds)
        cores = probes.measure(3.0) if args.contention in ("measured", "block") else in_load() \
            if args.contention == "engine" else None         # (block: recorded, for --resimulate --contention measured)
        if cores is not None:
            decode, extend = factors(cores)
            said = ": recorded, each block simulated with its own" if per_block else ""
            print(f"contention ({args.contention}{said}): decode steps {decode:.3f}, extend steps {extend:.3f}",
                  flush=True)
        sim_args = SIM + switches(args, cores) + [f"sim.answers={args.answers[0]}"]
        around = functools.partial(HostSpeed, probes, reference_s, per_block, args.collectives == "block", engine,
                                   by)
        lockstep = args.steal == "lockstep"
        repeats = []
        for k in range(args.repeats):               # real then simulated, repeat by repeat: both see the same drift
            work = args.work / f"repeat{k}"
            seeds = {which: LEVEL_SEEDS[which] + k for which in args.level_blocks} if level else None
            cases = (router_cases(args.quick, work, sim_args, around, lockstep, seeds, args.outside, k)
                     if "router_ablation" in args.studies else []) \
                + (scheme_cases(args.quick, work, sim_args, around, lockstep, seeds, args.collectives == "block")
                   if "dp_attn_vs_tp" in args.studies else [])
            print(f"repeat {k + 1}/{args.repeats} done ({time.time() - t0:.0f} s)", flush=True)
            repeats.append(cases)
        load["after"] = os.getloadavg()
        if cores is not None:                         # a check of how it held over the run (not used)
            cores["after"] = in_load() if args.contention == "engine" else probes.measure(3.0)
    cells = tables.combine(repeats)
    for c in cells:
        c["errors"] = tables.errors(c)
    print(tables.table(cells))
    print(tables.range_table(cells, load))
    print(tables.work_table(cells))
    print(tables.level_table(cells))
    print(tables.turn_table(cells))
    args.out.mkdir(parents=True, exist_ok=True)
    tables.plot(cells, args.out / "sim_vs_real.png")
    out = {"experiment": "sim_fidelity", "git_sha": git_sha(), "wall_s": time.time() - t0, "quick": args.quick,
           "repeats": args.repeats, "sim_args": sim_args, "load_average": load, "profile_host_check": host,
           "host_contention": cores,
           "note": ("shared 2-core machine: real runs ran beside other work (load average and the background "
                    "processes measured during each real run are recorded); medians over interleaved repeats"),
           "cases": [{k: c[k] for k in ("case", "study", "overrides", "repeats", "real_spread", "sim_spread",
                                        "inside_real_range", "real_below_sim", "errors", "host_background",
                                        "host_background_range", "host_steal",
                                        "host_scales", "host_levels", "levels_needed", "ttft_by_turn", "real",
                                        "sim")}
                     for c in cells],
           "host_scale": args.host_scale, "level_blocks": args.level_blocks if level else None,
           "outside": args.outside, "steal": args.steal, "level_waits": args.level_waits,
           "runs": [[{"case": c["case"], "host_background": c["host_background"], "host_steal": c["host_steal"],
                      "host_scale": c["host_scale"],
                      "host_pinned_s": c["host_pinned_s"], "host_contentions": c["host_contentions"],
                      "host_collective_s": c["host_collective_s"], "host_engine_s": c["host_engine_s"],
                      "host_level": c.get("host_level"), "level_block": c.get("level_block"),
                      "level_block_after": c.get("level_block_after"),
                      "level_needed": c.get("level_needed"),
                      "real": {k: c["real"].get(k) for k in KEEP}, "sim": {k: c["sim"].get(k) for k in KEEP}}
                     for c in rep] for rep in repeats]}
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (args.out / "table.md").write_text(tables.range_table(cells, load) + "\n" + host_line(host) + "\n\n"
                                       + tables.work_table(cells) + "\n\n" + tables.level_table(cells) + "\n\n"
                                       + tables.turn_table(cells) + "\n")
    print(f"results: {args.out / 'results.json'}  table: {args.out / 'table.md'}  plot: {args.out / 'sim_vs_real.png'}"
          f"  ({out['wall_s']:.0f} s)")


def engine_contention(siblings: int = 1, clock: str = "wall", rounds: int = 2) -> dict:
    """experiments/calibrate/contention.py's factors, measured now beside ``siblings`` busy engines on ``clock``,
    alone / beside ``rounds`` times: ``decode`` and ``extend``."""
    out = subprocess.run([sys.executable, str(ROOT / "experiments/calibrate/contention.py"), "--siblings",
                          str(siblings), "--clock", clock, "--rounds", str(rounds)], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[0])


def factors(cores: dict) -> tuple[float, float]:
    """(decode, extend) contention from a measurement: contention.py's per kind, or host_probe's one for both."""
    decode = cores.get("decode", cores.get("contention"))
    return decode, cores.get("extend", decode)


def given_factors(text: str) -> tuple[float, float]:
    """(decode, extend) contention as --contention gives it: one factor for both, or `decode,extend`."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(v > 0 for v in values):
        sys.exit(f"--contention {text!r}: none, measured, block, engine, a factor > 0, or two (decode,extend)")
    return values[0], values[-1]


def switches(args, cores: dict | None = None) -> list[str]:
    """The calibrated cost model's switches and the host's sharing (and contention: ``cores``, as measured, or the
    --contention factor) this run simulates with."""
    cost = [f"sim.cost.path={args.profile}", f"sim.cost.between={args.between}", f"sim.cost.point={args.point}",
            f"sim.cost.extend={args.extend}", f"sim.cost.prefix_regime={args.prefix_regime}",
            f"sim.cost.serving={args.serving}", f"sim.host_sharing={args.sharing}"] \
        + (["sim.batch_arrivals=true"] if args.batch_arrivals else []) \
        + (["sim.cost.host_scale_waits=true"] if args.level_waits == "scaled" else [])
    if args.contention == "block":                # each block's own (sim_config)
        return cost
    decode, extend = factors(cores) if cores else (1.0, 1.0) if args.contention in ("none", "measured", "engine") \
        else given_factors(args.contention)
    busy = [f"sim.host_contention_busy={cores.get('siblings', 1) + 1}"] \
        if cores and args.contention == "engine" and args.contention_busy == "measured" else []
    return cost + [f"sim.host_contention={decode:.4f}", f"sim.host_contention_extend={extend:.4f}"] + busy


def fill_outside(stored: dict, work: Path, which: list[str]) -> None:
    """A run before round N kept of its level blocks only what read_level took then: the TTFT's split
    (OUTSIDE_KEYS) is filled in from their full figures in the run's --work folder (repeat k's blocks in
    `repeat<k>/level*/router_ablation/results.json`), where found."""
    for k, rep in enumerate(stored["runs"]):
        for w in which:
            path = _level_dir(work / f"repeat{k}", w) / "router_ablation" / "results.json"
            trials = {case: t for case, _, t in router_trials(path)} if path.exists() else {}
            for run in rep:
                block = run.get(_block_key(w))
                if block and run["case"] in trials and any(block["real"].get(key) is None for key in OUTSIDE_KEYS):
                    found = trials[run["case"]]
                    if found.get("extend_cpu_s") != block["real"]["extend_cpu_s"]:
                        sys.exit(f"--outside: {path} is not the run's level block of repeat {k + 1}, "
                                 f"{run['case']} (extend CPU {found.get('extend_cpu_s')} s, stored "
                                 f"{block['real']['extend_cpu_s']} s): another run wrote over --work")
                    block["real"].update({key: found.get(key) for key in OUTSIDE_KEYS})


def resimulate_main(args) -> None:
    """--resimulate: the stored run's real runs, simulated with each --answers (and --between); prints each range
    table and writes --resim-out."""
    stored = json.loads(args.resimulate.read_text())
    out = {"experiment": "sim_fidelity re-simulation", "git_sha": git_sha(), "source": str(args.resimulate),
           "source_git_sha": stored.get("git_sha"), "source_sim_args": stored.get("sim_args"), "runs": {}}
    ran_with = next((a.split("=", 1)[1] for a in stored.get("sim_args", []) if a.startswith("sim.cost.path=")),
                    DEFAULT_PATH)                 # (runs before --profile: the default profile)
    args.profile = args.profile or ran_with
    if args.profile != ran_with:
        print(f"profile: {args.profile}, where {args.resimulate} was simulated with {ran_with}", flush=True)
    out["profile"] = args.profile
    from plugins.cost.calibrated import read_calibration
    reference_s, by = scale_reference(read_calibration(args.profile).get("host_probe"), args.host_scale)
    if reference_s is not None and any(not r.get(by) for rep in stored["runs"] for r in rep):
        sys.exit(f"--host-scale {args.host_scale}: {args.resimulate} took no such host speed around its blocks (it "
                 f"ran with --host-scale {stored.get('host_scale')}); give --host-scale none")
    cores = stored.get("host_contention") if args.contention in ("measured", "engine") else None
    if args.contention in ("measured", "engine") and not cores:
        sys.exit(f"--contention {args.contention}: {args.resimulate} measured none; give a factor, or none")
    if args.contention == "engine" and (cores.get("siblings", 1), cores.get("clock", "wall")) != \
            (args.contention_siblings, args.contention_clock):
        print(f"WARNING: --contention engine takes the stored run's factors, measured beside "
              f"{cores.get('siblings', 1)} engine(s) on the {cores.get('clock', 'wall')} clock; "
              f"--contention-siblings/--contention-clock do not apply to --resimulate", flush=True)
    per_block = args.contention == "block"
    if args.host_scale == "level" and any(not all(stored_blocks(r, args.level_blocks).values())
                                          for rep in stored["runs"] for r in rep):
        ran = stored.get("level_blocks") or (["before"] if stored.get("host_scale") == "level" else ["none"])
        sys.exit(f"--host-scale level --level-blocks {' '.join(args.level_blocks)}: {args.resimulate} did not run "
                 f"those level blocks (it ran with --host-scale {stored.get('host_scale')}, level blocks "
                 f"{' '.join(ran)}); give the ones it ran, or --host-scale none")
    if args.collectives == "block" and any(None in (r.get("host_collective_s") or [None]) for rep in stored["runs"]
                                           for r in rep):
        sys.exit(f"--collectives block: {args.resimulate} took no collective latency around its blocks; give none")
    if args.steal == "lockstep" and any(r.get("host_steal") is None for rep in stored["runs"] for r in rep):
        sys.exit(f"--steal lockstep: {args.resimulate} did not measure the steal during its blocks (before 511d0b5); "
                 f"give --steal processes")
    if per_block and any(not r.get("host_contentions") for rep in stored["runs"] for r in rep):
        sys.exit(f"--contention block: {args.resimulate} took no contention around its blocks; give measured, a "
                 f"factor, or none")
    if args.outside != "none":
        fill_outside(stored, args.work, args.level_blocks)
    for answers in args.answers:
        sim_args = SIM + switches(args, cores) + [f"sim.answers={answers}"]
        t0 = time.time()
        cells, text = resimulate(stored, sim_args, reference_s, per_block, args.collectives == "block",
                                 args.steal == "lockstep", args.blocks, by,
                                 args.level_blocks if args.host_scale == "level" else [],
                                 outside=args.outside)
        print(f"sim.answers={answers}, {' '.join(switches(args, cores))} ({time.time() - t0:.0f} s)\n{text}\n"
              f"{tables.work_table(cells)}\n{tables.level_table(cells)}\n{tables.turn_table(cells)}\n", flush=True)
        out["runs"][answers] = {"sim_args": sim_args, "table": text, "host_scale": args.host_scale,
                                "level_blocks": args.level_blocks if args.host_scale == "level" else None,
                                "outside": args.outside, "steal": args.steal, "level_waits": args.level_waits,
                                "reference_pinned_s": reference_s if by == "host_pinned_s" else None,
                                "reference_engine_s": reference_s if by == "host_engine_s" else None,
                                "host_contention": cores,
                                "cases": [{k: c[k] for k in ("case", "real_spread", "sim_spread", "inside_real_range",
                                                              "errors", "host_scales", "host_levels",
                                                              "levels_needed", "ttft_by_turn")}
                                          for c in cells]}
    if args.resim_out is None:     # named by the run and the switches, so one re-simulation never overwrites another's
        run = str(stored.get("git_sha") or "run").split("+")[0][:7]      # (the run's commit: another run, another name)
        name = "_".join([run, args.between, args.point, args.extend, args.sharing, f"serving_{args.serving}"]
                        + ([] if args.contention == "none" else [f"contention_{args.contention}"])
                        + ([] if args.contention_busy == "cores" else [f"busy_{args.contention_busy}"])
                        + ([] if args.collectives == "none" else [f"collectives_{args.collectives}"])
                        + ([] if args.steal == "processes" else [f"steal_{args.steal}"])
                        + (["batch_arrivals"] if args.batch_arrivals else [])
                        + (["waits_scaled"] if args.level_waits == "scaled" else [])
                        + ([] if args.outside == "none" else [f"outside_{args.outside}"])
                        + ([] if args.host_scale == "none" else [f"host_{args.host_scale}"])
                        + ([] if args.host_scale != "level" or args.level_blocks == ["before"]
                           else ["blocks_" + "_".join(args.level_blocks)])
                        + ([] if args.profile == ran_with else [f"profile_{Path(args.profile).stem}"]))
        args.resim_out = HERE / f"resim_{name}_answers_{'_'.join(args.answers)}.json"
    args.resim_out.parent.mkdir(parents=True, exist_ok=True)
    args.resim_out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {args.resim_out}")


if __name__ == "__main__":
    main()
