"""Calibrate `sim.cost=calibrated` on this machine: profile the real engine's steps and save them as JSON.

For each instance config (parallel x size, moe), one real instance (framework.instance.client.open_engine:
a thread for one rank, spawned ranks otherwise) serves controlled batches through the engine seam, and the step
times are read where a client sees them, between consecutive token deliveries (scheduling, the ranks' exchange and
collectives included):

- prefill: one request of `n` new tokens on top of a cached prefix of `p` tokens (the prefix is served first, on
  every DP group), on an idle instance: its time to first token, the fastest and the median of --repeats, taken in
  sweeps of every point in a shuffled order (`--prefill-order interleaved`, since 2026-12-04: this host's speed moves
  1.3-1.7x between minutes, more than the engine's two attention forms differ) or point by point (`points`);
- decode: `b` requests (prompts of `c` tokens, no shared prefix) decoding together: the mean gap between one's
  tokens once every one of them decodes (tokens that arrive together count as one gap each: a slow poll does not
  matter), the fastest and the median of --repeats (DP attention: the dispatcher spreads them over the DP groups).

Both are kept (`seconds`, `seconds_median`) and `sim.cost.point` picks one. The fastest is the instance's own cost
with nothing else stretching it; the median is what a step typically takes on this host, whose speed wanders (the
profile of 8fa7f27: the median is 1.01-1.52x the fastest, 1.09-1.18x at the median point). The profile records the
load average it ran under.

The host's speed moves while it is profiled (on 2026-12-03 the probe moved 10.9 -> 16.3 ms over one 13-minute
profile, and the host ran 1.5x faster an hour later), so before each point the host's speed is taken with
framework/core/host_probe (0.3 s of the probe's work on each core in turn: no placement in it; `pinned` in this
process until 2e3a2ac, `Cores`' pinned processes since), and each point's
seconds are expressed at one reference speed: x (the reference / the host's speed then), the reference being the mean
of every point's, which the profile carries as `host_probe.pinned_s`. The host's speed at a point is the mean of its
own and its 3 neighbours' each side in measuring order (`pinned_s_smoothed`). The seconds as measured stay beside them
(`*_raw`, with each point's own in `pinned_s`). `--normalize none` keeps them as measured (the profiles before
2026-12-03), stamped with the reference all the same.

A step of several ranks is mostly waiting: on this VM one small all-reduce over gloo takes ~2 ms, and a two-rank
step of the tiny model waits on ~12 of them (~25 ms of ~36), a latency the compute probe does not measure. So before
each point the host is taken with framework/core/host_probe.Cores (its speed alone, with every core
busy, and one all-reduce's latency), the instance's collectives are counted over the point's steps, and a config of
several ranks is split: its waits (collectives per step x latency) come off each point and only the compute is
rescaled to the reference speed; plugins/cost/calibrated.py adds the waits back at the latency of the host it prices
(`sim.cost.collective_s`). The counts are over all of a point's steps (a decode point's extend steps too: 13-14
against 11-12, within a point's few percent). On this VM the latency was found to move with the compute probe, and
the split removed no error (experiments/sim_fidelity/notes_collectives.md): the committed profile is not split.

`--engine-probe` also times experiments/calibrate/engine_probe's fixed mix of the engine's own steps before each point
(`engine_s`) and stamps the profile with their mean (`host_probe.engine_s`): the speed experiments/sim_fidelity's
`--host-scale engine` scales a block to. On this AMD EPYC VM host_probe's work did not follow the engine's speed
(experiments/calibrate/probe_tracking.py), so a profile for that scale is normalized by the engine probe's readings
instead (`--normalize engine`: each point at the mean of the mix's, as `pinned` does with host_probe's). Round K took
its profile as measured (`--normalize none`) and scaled it to that mean, but its configs were measured at different
speeds (the one-rank config's prefill points at a mix of 0.67 s, the profile's mean 0.80): its one-rank extends were
priced 1.2x cheap. experiments/calibrate/renormalize.py derives either normalized twin from a profile as measured.

    python experiments/calibrate/run.py                 # the configs the fidelity runs use (~15 min)
    python experiments/calibrate/run.py --quick --out /tmp/c.json   # a smoke run (tests)

Writes data/calibration/cpu.json (or --out); plugins/cost/calibrated.py reads it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.instance.handle import SyncFace  # noqa: E402
from framework.instance.rank_loop import InstanceSpec  # noqa: E402
from framework.instance.client import open_engine  # noqa: E402
from framework.engine.request import Req, SamplingParams  # noqa: E402
from framework.core.host_probe import Cores, mismatch, probe  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.core.registry import PARALLELISM  # noqa: E402
from plugins.cost.calibrated import DEFAULT_PATH, config_key  # noqa: E402

CONFIGS = {   # key -> overrides; what experiments/sim_fidelity runs for real
    "single": ["parallel=single", "moe=reference"],
    "tp2": ["parallel=tp", "parallel.size=2", "moe=triton_fused"],
    "dp_attn2": ["parallel=dp_attn", "parallel.size=2", "moe=triton_fused"],
}
# 256 new tokens and 12 requests: the sizes whose steps fill the fidelity runs (long prefills under round robin, 4-16
# decoding requests under a KV budget), where a coarser grid left the fit below its own measured points; a prefix of 16:
# the engine's absorbed form on a small cached prefix (sim.cost.prefix_regime=absorbed prices the cached columns apart)
GRID = {"new": [8, 32, 128, 256, 512], "prefix": [0, 16, 256, 1024], "batch": [1, 2, 4, 8, 12, 16, 32],
        "context": [32, 256, 1024]}
QUICK = {"new": [8, 64], "prefix": [0, 64], "batch": [1, 4], "context": [32, 128]}
DECODE_TOKENS = 16
SMOOTH = 3              # neighbours each side whose speeds, with the point's own, give the host's speed at a point
POINT_PINNED_S = 0.3    # seconds of the probe's work on each core before each point
WAIT_FLOOR = 0.05       # a point whose waits on collectives seem to take it all keeps this share as its compute


def config_key_of(name: str) -> str:
    cfg = compose(CONFIGS[name])
    return config_key(cfg.parallel.name, cfg.parallel.size, cfg.moe.name)


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def _serve(face: SyncFace, prompts: list[list[int]], max_new: int) -> list[list[float]]:
    """Serve the prompts at once; each request's token arrival times."""
    reqs = [Req(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for p in prompts]
    times = {r.rid: [] for r in reqs}
    start = time.perf_counter()
    for r in reqs:
        face.add(r)
    while not all(r.finished for r in reqs):
        out = face.step(timeout=1.0) or []
        now = time.perf_counter()
        for r in out:
            if r.rid in times:
                times[r.rid] += [now] * (len(r.output_ids) - len(times[r.rid]))
    return [[start] + times[r.rid] for r in reqs]


class Readings:
    """The host before a point: host_probe.Cores' readings, and with an engine probe open (--engine-probe:
    experiments/calibrate/engine_probe, a fixed mix of the engine's own steps) its step CPU as `engine_s`, the speed
    experiments/sim_fidelity's `--host-scale engine` scales to."""

    def __init__(self, cores: Cores, engine=None) -> None:
        self.cores, self.engine = cores, engine

    def measure(self, seconds: float) -> dict:
        out = self.cores.measure(seconds)
        return out if self.engine is None else {**out, "engine_s": self.engine.measure()}


def _probed(measure, handle, cores: Cores | Readings, speeds: list[dict]):
    """``measure()``, after taking the host's speed, alone and with every core busy, and its collectives' latency
    (host_probe.Cores), appended to ``speeds`` with the collectives the instance waited on per step meanwhile."""
    host = cores.measure(POINT_PINNED_S)
    before = handle.stats()
    out = measure()
    after = handle.stats()
    steps = after["steps"] - before["steps"]
    host["collectives_per_step"] = (after.get("collectives", 0) - before.get("collectives", 0)) / steps if steps \
        else 0.0
    speeds.append(host)
    return out


def profiled_engine(overrides: list[str], seed: int = 0):
    """A real instance of ``overrides`` as the profile measures one (its largest batch fits; no logger): its config,
    handle and a synchronous face on it. Every calibrate script opens its engine here."""
    cfg = compose(overrides + ["engine.kv_budget_mb=64", "logger.mode=disabled"])
    handle = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, seed))
    return cfg, handle, SyncFace(handle)


def profile(overrides: list[str], grid: dict, repeats: int, cores: Cores, seed: int = 0,
            interleaved: bool = True) -> dict:
    cfg, handle, face = profiled_engine(overrides, seed)
    rng = random.Random(seed)
    try:
        _serve(face, [_text(rng, 64)], 4)                              # warm-up
        dp = PARALLELISM.get(cfg.parallel.name).dp_size(cfg.parallel)
        pre_speeds, dec_speeds = [], []
        prefill = _prefill_grid(face, rng, grid, repeats, dp, handle, cores, pre_speeds, interleaved)
        decode = [[_probed(lambda: [_decode(face, rng, b, c) for _ in range(repeats)], handle, cores, dec_speeds)
                   for c in grid["context"]] for b in grid["batch"]]
    finally:
        handle.close()
        handle.terminate()
    return {"key": config_key(cfg.parallel.name, cfg.parallel.size, cfg.moe.name), "overrides": overrides,
            "prefill": {"new": grid["new"], "prefix": grid["prefix"], **_points(prefill, pre_speeds),
                        "order": "interleaved" if interleaved else "points"},
            "decode": {"batch": grid["batch"], "context": grid["context"], **_points(decode, dec_speeds)}}


def _prefill_grid(face: SyncFace, rng: random.Random, grid: dict, repeats: int, dp: int, handle, cores: Cores,
                  speeds: list[dict], interleaved: bool) -> list[list[list[float]]]:
    """Each prefill point's repeats. ``interleaved``: each repeat is one sweep of every point in a shuffled order,
    the host taken before each sweep, so a drift of the host's speed lands on every point alike and the points keep
    their ratios (the engine's two attention forms differ by 1.1-1.3x at 512 new tokens, less than the host moves
    between points minutes apart); each point's host readings (its collectives per step among them) are then the
    sweeps' mean. Otherwise a point's repeats run
    back to back, the host taken before each point."""
    points = [(i, j) for i in range(len(grid["new"])) for j in range(len(grid["prefix"]))]
    got = {pt: [] for pt in points}
    if not interleaved:
        for i, j in points:
            got[i, j] = _probed(lambda: [_prefill(face, rng, grid["new"][i], grid["prefix"][j], dp)
                                         for _ in range(repeats)], handle, cores, speeds)
    else:
        sweeps = []
        for _ in range(repeats):
            order = rng.sample(points, len(points))
            _probed(lambda: [got[i, j].append(_prefill(face, rng, grid["new"][i], grid["prefix"][j], dp))
                             for i, j in order], handle, cores, sweeps)
        mean = {k: statistics.fmean(s[k] for s in sweeps) for k, v in sweeps[0].items() if isinstance(v, float)}
        speeds += [mean] * len(points)
    return [[got[i, j] for j in range(len(grid["prefix"]))] for i in range(len(grid["new"]))]


def _rows(flat: list[float], shape: list[list]) -> list[list[float]]:
    """The points' speeds, flat in measuring order, as the grid's rows."""
    it = iter(flat)
    return [[next(it) for _ in row] for row in shape]


def _points(repeats: list[list[list[float]]], speeds: list[dict] | None = None) -> dict:
    """Each point's fastest repeat (`seconds`) and median (`seconds_median`): sim.cost.point picks one; and the host
    before it (``_probed``, flat in measuring order): its speed (`pinned_s`), how much slower its cores ran all busy
    than alone (`contention`: recorded), one collective's latency (`collective_s`) and the collectives per step
    (`collectives_per_step`), which ``normalize`` uses once every config is measured."""
    out = {"seconds": [[min(r) for r in row] for row in repeats],
           "seconds_median": [[statistics.median(r) for r in row] for row in repeats]}
    for key in ("pinned_s", "contention", "collective_s", "collectives_per_step", "engine_s"):
        if speeds is not None and key in speeds[0]:
            out[key] = _rows([m[key] for m in speeds], repeats)
    return out


def _smoothed(flat: list[float]) -> list[float]:
    """Each of a measuring order's values as the mean of its own and its SMOOTH neighbours' each side."""
    return [statistics.fmean(flat[max(0, i - SMOOTH):i + SMOOTH + 1]) for i in range(len(flat))]


def _in_order(pre: dict, dec: dict, key: str) -> list[float]:
    """A config's ``key`` (a host reading per point), prefill points then decode points, each smoothed over its
    measuring order. Interleaved prefill points were measured together (each has the sweeps' mean): they keep it, and
    only the decode points are smoothed, among themselves."""
    flat = lambda g: [x for row in g[key] for x in row]      # noqa: E731
    if pre.get("order") == "interleaved":
        return flat(pre) + _smoothed(flat(dec))
    return _smoothed(flat(pre) + flat(dec))


def normalize(profiles: dict, names: list[str], apply: bool = True, by: str = "pinned_s") -> float:
    """The reference speed of the profiles measured now, the mean of their points' readings ``by`` (host_probe's
    `pinned_s`, or the engine probe's `engine_s`) (returned: the stamp); ``apply``:
    each point's seconds x reference / the host's speed then (the mean of its own and its SMOOTH neighbours' each
    side, in measuring order: a config's prefill points, then its decode points), the seconds as measured kept
    (`*_raw`). A config whose steps wait on collectives (several ranks) is split first: a point's waits (its
    collectives per step x one collective's latency then, smoothed the same way) come off its seconds, and only the
    rest, the compute, is rescaled; the config then carries its `collectives_per_step` (the median of its prefill
    points', and of its decode points') and `collective_s` (their mean latency), which plugins/cost/calibrated.py adds
    back to each step, at the latency of the host it prices."""
    grids = [profiles[n][kind] for n in names for kind in ("prefill", "decode")]
    ref = statistics.fmean(x for g in grids for row in g[by] for x in row)
    if not apply:
        return ref
    for n in names:
        pre, dec = profiles[n]["prefill"], profiles[n]["decode"]
        flat = lambda key: [x for g in (pre, dec) for row in g[key] for x in row]      # noqa: E731 (measuring order)
        speed = iter(_in_order(pre, dec, by))
        split = ("collective_s" in pre and None not in flat("collective_s")
                 and max(flat("collectives_per_step")) > 0)
        if split:
            latency, per_step = flat("collective_s"), flat("collectives_per_step")
            waits = iter([k * c for k, c in zip(per_step, _in_order(pre, dec, "collective_s"))])
            profiles[n]["collectives_per_step"] = {kind: statistics.median(x for row in g["collectives_per_step"]
                                                                           for x in row)
                                                   for kind, g in (("prefill", pre), ("decode", dec))}
            profiles[n]["collective_s"] = statistics.fmean(latency)
        for g in (pre, dec):
            g[f"{by}_smoothed"] = [[next(speed) for _ in row] for row in g[by]]
            g["wait_s"] = [[next(waits) if split else 0.0 for _ in row] for row in g[by]]
            for key in ("seconds", "seconds_median"):
                g[f"{key}_raw"] = g[key]
                g[key] = [[max(s - w, WAIT_FLOOR * s) * ref / sp for s, w, sp in zip(row, wrow, srow)]
                          for row, wrow, srow in zip(g[key], g["wait_s"], g[f"{by}_smoothed"])]
    return ref


def _cached_prefix(face: SyncFace, rng: random.Random, p: int, dp: int = 1) -> list[int]:
    """A fresh prompt of ``p`` tokens, served first so that it is cached on every DP group (wherever the dispatcher
    sends the request that extends it)."""
    prefix = _text(rng, p)
    for _ in range(dp if p else 0):
        _serve(face, [prefix], 1)
    return prefix


def _prefill(face: SyncFace, rng: random.Random, n: int, p: int, dp: int) -> float:
    prefix = _cached_prefix(face, rng, p, dp)
    (times,) = _serve(face, [prefix + _text(rng, n)], 1)
    return times[1] - times[0]


def _decode(face: SyncFace, rng: random.Random, b: int, c: int) -> float:
    runs = _serve(face, [_text(rng, c) for _ in range(b)], DECODE_TOKENS)
    steady = max(t[1] for t in runs)                                   # every request decodes from here
    times = [t for t in runs[0][1:] if t >= steady]                    # one request: one token per step
    if len(times) < 2:
        raise RuntimeError(f"decode b={b} c={c}: the batch never decoded together (KV too small for it?)")
    return (times[-1] - times[0]) / (len(times) - 1)


def rebase(profiles: dict, kept: set[str], serving: dict | None, old_stamp: dict, reference: float) -> dict | None:
    """The configs and serving measurement kept from the earlier profile, at the new ``reference`` speed: x (new /
    old reference) where the old profile was normalized; otherwise they are at their host's speed then, which is
    said (the serving measurement is dropped then: re-measure it with experiments/calibrate/serving.py)."""
    old = old_stamp.get("pinned_s") if old_stamp.get("normalized") == "pinned" else None
    if old is None:
        if kept:
            print(f"WARNING: {sorted(kept)} are kept from a profile not normalized to a reference speed", flush=True)
        if serving:
            print("WARNING: the serving measurement was not normalized: dropped; re-measure it with "
                  "experiments/calibrate/serving.py", flush=True)
        return None
    k = reference / old
    for key in kept:
        for kind in ("prefill", "decode"):
            g = profiles[key][kind]
            for name in ("seconds", "seconds_median"):
                if name in g:
                    g[name] = [[s * k for s in row] for row in g[name]]
    if serving:
        serving = {**serving, "request_cpu_s": serving["request_cpu_s"] * k, "token_cpu_s": serving["token_cpu_s"] * k,
                   "normalized_to_pinned_s": reference}
    return serving


def stamp(before: dict, after: dict, pinned_s: float, normalized: str) -> dict:
    """framework.core.host_probe's probe, taken before and after profiling: the mean is the stamp (a host whose
    speed moved during the profile is said: the profile then mixes two speeds, unless ``normalized``); ``pinned_s``,
    host_probe's reference speed (``normalize``'s); and ``normalized``: by which readings the points were expressed
    at one speed (pinned, engine: the engine probe's, whose reference run.py stamps as `engine_s`), or none."""
    for problem in mismatch(before, after):
        print(f"WARNING: the host changed during profiling (probe after vs before): {problem}"
              + ("; each point is expressed at the reference speed" if normalized != "none" else ""), flush=True)
    return {**before, "probe_s": (before["probe_s"] + after["probe_s"]) / 2,
            "probe_s_before_after": [before["probe_s"], after["probe_s"]], "pinned_s": pinned_s,
            "normalized": normalized}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=5)   # each point's fastest and median of 5
    ap.add_argument("--quick", action="store_true", help="a small grid, one repeat: the smoke test")
    ap.add_argument("--prefill-order", choices=["interleaved", "points"], default="interleaved",
                    help="interleaved: each repeat sweeps every prefill point in a shuffled order (_prefill_grid); "
                         "points: a point's repeats back to back (the profiles before 2026-12-04 10:40 UTC)")
    ap.add_argument("--normalize", choices=["pinned", "engine", "none"], default="pinned",
                    help="each point at the reference speed by host_probe's readings (pinned) or the engine probe's "
                         "(engine: needs --engine-probe), a config of several ranks split first (module doc); "
                         "none: as measured")
    ap.add_argument("--engine-probe", action="store_true",
                    help="before each point, also time engine_probe's mix (the engine's own steps): the profile is "
                         "stamped with its mean (`host_probe.engine_s`), which sim_fidelity --host-scale engine reads")
    ap.add_argument("--out", type=Path, default=ROOT / DEFAULT_PATH, help="updated in place: other configs are kept")
    args = ap.parse_args()
    if args.normalize == "engine" and not args.engine_probe:
        ap.error("--normalize engine expresses each point at the engine probe's speed: it needs --engine-probe")
    import torch
    torch.set_num_threads(1)
    grid, repeats = (QUICK, 1) if args.quick else (GRID, args.repeats)
    t0 = time.perf_counter()
    before = probe()          # the host as profiled, stamped on the profile (sim_fidelity checks it against its own)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    profiles = dict(old.get("profiles", {}))        # configs not profiled this time are kept
    kept = set(profiles) - {config_key_of(n) for n in args.configs}     # (moved to this profile's speed: rebase)
    if kept and args.normalize == "engine":
        sys.exit(f"--normalize engine: {args.out} holds configs not profiled now ({sorted(kept)}), at a speed the "
                 f"engine probe did not read: profile every config in one run (--configs), or write a new --out")
    keys = []
    from engine_probe import EngineProbe            # (this script's folder: on sys.path when run)
    with Cores() as cores, (EngineProbe() if args.engine_probe else contextlib.nullcontext()) as engine:
        for name in args.configs:
            p = profile(CONFIGS[name], grid, repeats, Readings(cores, engine),
                        interleaved=args.prefill_order == "interleaved")
            keys.append(p["key"])
            profiles[p["key"]] = p
            print(f"{p['key']}: prefill {[round(x * 1e3, 2) for x in p['prefill']['seconds'][0]]} ms "
                  f"(n={grid['new'][0]}), decode {[round(row[0] * 1e3, 2) for row in p['decode']['seconds']]} ms "
                  f"(c={grid['context'][0]})", flush=True)
    reference = normalize(profiles, keys, apply=args.normalize == "pinned")
    serving = old.get("serving")
    if args.normalize == "pinned":        # what is kept was expressed at the old reference: move it to the new one
        serving = rebase(profiles, kept, serving, (old.get("host_probe") or {}), reference)
    elif serving:             # measured at another hour (and maybe at the old pinned reference): not this profile's
        print(f"WARNING: the serving measurement in {args.out} was taken with the earlier profile: dropped; "
              f"re-measure it with experiments/calibrate/serving.py --out {args.out}", flush=True)
        serving = None
    host = stamp(before, probe(), reference, args.normalize)
    if args.engine_probe:     # the engine's speed over the profile: the points' mean, their reference under engine
        host["engine_s"] = normalize(profiles, keys, apply=args.normalize == "engine", by="engine_s")
    out = {"model": compose([]).model.name, "host": os.uname().nodename, "cpu_count": os.cpu_count(),
           "loadavg_1m": os.getloadavg()[0], "host_probe": host,
           "profiled_now": list(args.configs), "torch_threads": 1, "git_sha": git_sha(),
           "prefill_order": args.prefill_order,
           "engine_host_allocator_cache": compose([]).engine.host_allocator_cache,   # the engines' allocator, as profiled
           "wall_s": time.perf_counter() - t0, "note": "shared machine: other processes ran beside the profile",
           "profiles": profiles, **({"serving": serving} if serving else {})}   # serving.py's
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['wall_s']:.0f} s (load average {out['loadavg_1m']:.1f})")


if __name__ == "__main__":
    main()
