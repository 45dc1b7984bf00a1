"""sim/cost=calibrated: step times measured on the real engine of this machine (experiments/calibrate).

The profile holds, per instance config (parallel x size, moe), a prefill grid (new tokens x cached prefix: one
request's time to first token on an idle instance) and a decode grid (requests x prompt tokens: the gap between
tokens). Each grid is fitted by least squares (relative error) to the shape of a step's work:

- EXTEND batch of n new tokens on a cached prefix of p (token-weighted mean): c0 + c1 n + c2 n p + c3 n^2; with
  ``extend=per_request`` a batch of several requests (n_i new tokens on p_i each) is priced by that form with the
  attention terms summed per request, c0 + c1 sum n_i + c2 sum n_i p_i + c3 sum n_i^2 (the engine attends request by
  request: framework/model/attention.py), scaling the grid's point of the whole batch under ``between=grid``;
  ``extend=batch`` (the default, as every committed figure was priced) prices the batch as one request of its total;
- DECODE batch of b requests of mean context c: c0 + c1 b + c2 b c, with b = n x DP groups for a group of n (the
  profile's decode batches were spread evenly over the DP groups);
- the step: its slowest batch (the ranks wait for each other at every layer); IDLE batches cost nothing.

``between=fit`` (the default) prices a step with the fit: it smooths the noise of points measured on a shared
machine, and misses what the shape cannot follow (on this CPU a prefill of 512 new tokens on a cached prefix costs
4-5.5x what 256 do: 324 against 59 ms on 256 cached tokens, where the fit gives 156). ``between=grid`` prices a step
inside the measured grid by the measured points, bilinear between them (each point is already the fastest of its
repeats), and past the grid's edges by the fit's growth from the nearest edge point: a lookup of what was measured
(Vidur fits a random forest to its points instead), with the fit only where nothing was measured.

``prefix_regime=absorbed`` (servelab's, a named switch; ``smooth`` the default, as every committed figure was priced)
prices an extend batch in the regime the engine runs it in. The MLA engine attends a batch in the weight-absorbed form
when any of its requests has a cached prefix or earlier chunk, and in the normal form otherwise
(framework/model/attention.py, as SGLang v0.4). The absorbed form costs more even on a tiny prefix: on an AMD EPYC host
(2026-12-04, calibrate's own prefill measure) 512 new tokens took 87 ms on no prefix, 102 on 8 cached tokens and 151 on
256. ``smooth`` reads one grid across both regimes, so a small prefix gets the normal form's price plus a sliver of the
slope to the first cached column. ``absorbed`` prices a batch with no cached prefix from the profile's p = 0 column
alone, and any other batch from its cached columns alone. Those have their own fit, from which a prefix below the
smallest measured one is extrapolated. It needs a profile with at least two cached columns; for small prefixes, one
near 0 (experiments/calibrate's grid measures 16 since 2026-12-04).

``point=fastest`` (the default, as every committed figure was priced) reads each point's fastest repeat, the
instance's own cost; ``point=median`` its median repeat, what a step typically takes on the profiled host.

``serving=measured`` prices a one-rank HTTP worker's own CPU outside its engine's steps (parsing, tokenizing,
streaming, the rank loop's turns between steps: experiments/calibrate/serving.py), per request and per answer token,
in series with the steps (one process, one GIL; framework/sim/instance.py adds a request's to the step after its
arrival and a token's to the step that samples it); ``none`` (the default).

``host_scale`` (1.0 by default: the host at its profile's speed) multiplies every priced second, steps and serving
alike: the host's slowness now against its profiling, as framework/core/host_probe measures it (a fixed piece of work
shaped like the engine's steps, on each core in turn: ``pinned``, or ``Cores`` since 2e3a2ac), for a host whose speed
moves between the profile and the run (experiments/sim_fidelity ``--host-scale pinned`` sets it from that probe around
each real block, never from the run). ``host_scale_extend`` (None: ``host_scale``) scales the steps that extend apart,
``host_scale`` then the decode steps and the serving: the engines' own levels by step kind, as sim_fidelity
``--host-scale level`` reads them from a run before the judged one.

A profile of several ranks measured since 2e3a2ac splits each step (experiments/calibrate): the ranks' waits on their
collectives (the profile's `collectives_per_step` by the step's kind, extend or decode, each at `collective_s`,
host_probe.Cores' all-reduce latency then) and the rest, the compute, which ``host_scale`` scales. The waits are
priced at ``collective_s`` (None: the profile's own): on this VM ~2 ms each, ~25 ms of a two-rank step of ~36. The
committed profile is not split (experiments/sim_fidelity/notes_collectives.md: the split removed no error here).
``host_scale_waits`` scales the profile's latency by ``host_scale`` as well (a ``collective_s`` given is the host's
own and is not scaled): one small all-reduce over gloo moves with the host as the compute does (2026-12-05: 1.1-1.7
ms, host_probe.Cores, where cpu_amd_epyc_l.json's DP profile holds 2.2 and its probe 11.8 ms against 7.4 now:
0.5-0.8x and 0.63x); off, a two-rank level read from a block's duration
(experiments/sim_fidelity --host-scale level) is left to its compute alone and floors where the profile's waits
outlast the block (DP x2 in rounds N-P).

Only what was profiled can be priced: another model or config is refused with the calibrated ones listed. A profile
prices its own CPU's host: where it was stamped on another CPU model than this host's, that is logged once per profile
with the committed profiles (data/calibration/) that were stamped on this one (sim.cost.path picks one).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import partial

from framework.core.host_probe import cpu_model
from framework.core.paths import REPO_ROOT
from framework.core.registry import COST
from framework.contracts.cost import CostConfig, CostModel, InstanceShape, Step
from framework.gpu.tables import segment

DEFAULT_PATH = "data/calibration/cpu.json"


def config_key(parallel: str, size: int, moe: str) -> str:
    return f"{parallel}x{size}/{moe}"


@dataclass
class CalibratedConfig(CostConfig):
    name: str = "calibrated"
    path: str = DEFAULT_PATH          # the profile (relative: to the repository)
    between: str = "fit"              # how a step between the measured points is priced: fit | grid (module doc)
    extend: str = "batch"             # a multi-request extend batch: batch (one request of its total) | per_request
    point: str = "fastest"            # each measured point's fastest repeat | its median (experiments/calibrate)
    serving: str = "none"             # an HTTP worker's CPU per request outside its steps: none | measured (the profile's)
    host_scale: float = 1.0           # every priced second x this: the host's probe now / at profiling (module doc)
    host_scale_extend: float | None = None   # a step that extends x this instead (None: host_scale; module doc)
    collective_s: float | None = None  # one collective's seconds on the host; None: the profile's (module doc)
    host_scale_waits: bool = False    # the profile's waits on collectives x host_scale too (module doc)
    prefix_regime: str = "smooth"     # an extend's price: smooth (one grid) | absorbed (by the engine's form: module doc)


BETWEEN = ("fit", "grid")
EXTEND = ("batch", "per_request")
POINTS = {"fastest": "seconds", "median": "seconds_median"}     # sim.cost.point -> the profile's key
SERVING = ("none", "measured")
PREFIX_REGIMES = ("smooth", "absorbed")


PREFILL_TERMS = (lambda n, p: 1.0, lambda n, p: n, lambda n, p: n * p, lambda n, p: n * n)
DECODE_TERMS = (lambda b, c: 1.0, lambda b, c: b, lambda b, c: b * c)


def prefill_time(coef: list[float], n: float, p: float) -> float:
    """PREFILL_TERMS' sum, written out (the simulator's hot path)."""
    return coef[0] + n * (coef[1] + coef[2] * p + coef[3] * n)


def decode_time(coef: list[float], b: float, c: float) -> float:
    """DECODE_TERMS' sum, written out."""
    return coef[0] + b * (coef[1] + coef[2] * c)


class Fit:
    """seconds ~ sum_i coef_i term_i(x, y), fitted by least squares on the grid's relative errors; the coefficients
    are kept >= 0 (a term that fits negative is dropped and the rest refitted) so no step costs less with more work."""

    def __init__(self, terms, xs: list[float], ys: list[float], seconds: list[list[float]]):
        import numpy as np
        points = [(x, y, s) for x, row in zip(xs, seconds) for y, s in zip(ys, row)]
        keep = list(range(len(terms)))
        while True:
            a = np.array([[terms[i](x, y) / s for i in keep] for x, y, s in points])
            coef = np.linalg.lstsq(a, np.ones(len(points)), rcond=None)[0]
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        self.coef = [0.0] * len(terms)                                  # a dropped term: 0
        for i, c in zip(keep, coef):
            self.coef[i] = max(float(c), 0.0)
        self.error = float(np.sqrt(np.mean((a @ coef - 1) ** 2)))     # RMS relative error on the grid


class Grid:
    """The measured points read between them (bilinear), and past the grid's edges the fit's growth from the nearest
    edge point: grid(edge) x fit(x, y) / fit(edge) (grid(edge) + fit(x, y) where the fit is 0 at the edge)."""

    def __init__(self, xs: list[float], ys: list[float], seconds: list[list[float]], fit) -> None:
        for name, keys in (("first", xs), ("second", ys)):
            if len(keys) < 2 or any(b <= a for a, b in zip(keys, keys[1:])):
                raise ValueError(f"sim.cost.between=grid needs at least 2 increasing points on the grid's {name} "
                                 f"axis, the profile has {list(keys)}: re-profile it, or use sim.cost.between=fit")
        self.xs, self.ys, self.s, self.fit = list(xs), list(ys), seconds, fit

    def __call__(self, x: float, y: float) -> float:
        xs, ys, s = self.xs, self.ys, self.s
        (i, wx), (j, wy) = segment(xs, x), segment(ys, y)
        t = ((1 - wx) * ((1 - wy) * s[i][j] + wy * s[i][j + 1])
             + wx * ((1 - wy) * s[i + 1][j] + wy * s[i + 1][j + 1]))
        cx, cy = min(max(x, xs[0]), xs[-1]), min(max(y, ys[0]), ys[-1])
        if cx != x or cy != y:  # past an edge: the fit's growth from the edge
            edge = self.fit(cx, cy)
            t = t * self.fit(x, y) / edge if edge > 0 else t + self.fit(x, y)
        return t


logger = logging.getLogger(__name__)
_told: set[str] = set()   # the profiles whose host was compared with this one's (once per profile and process)


def tell_host(path: str, data: dict) -> None:
    """Log, once per profile, that it was stamped on another CPU model than this host's, naming the committed profiles
    that were stamped on this one."""
    if path in _told:
        return
    _told.add(path)
    theirs, ours = (data.get("host_probe") or {}).get("cpu_model"), cpu_model()
    if theirs is None or theirs == ours:
        return
    same = []
    for other in sorted((REPO_ROOT / "data" / "calibration").glob("*.json")):
        try:
            if (json.loads(other.read_text()).get("host_probe") or {}).get("cpu_model") == ours:
                same.append(str(other.relative_to(REPO_ROOT)))
        except (OSError, ValueError):
            continue
    logger.info("sim.cost=calibrated: %s was profiled on %r; this host is %r: the simulation prices the profile's host "
                "(%s)", path, theirs, ours, f"profiled on this CPU: sim.cost.path={' or '.join(same)}" if same else
                "profile this one with experiments/calibrate/run.py --out <file>, then sim.cost.path=<file>")


def load_profile(path: str, instance: InstanceShape) -> dict:
    data = read_calibration(path)
    tell_host(path, data)
    key = config_key(instance.parallel, instance.size, instance.moe)
    if instance.model.name != data["model"] or key not in data["profiles"]:
        raise ValueError(f"sim.cost=calibrated has no profile of model={instance.model.name} {key} in {path} "
                         f"(calibrated: model={data['model']} with {', '.join(data['profiles'])}); profile it with "
                         f"experiments/calibrate/run.py, or use sim.cost=roofline")
    return data["profiles"][key]


def read_calibration(path: str) -> dict:
    p = REPO_ROOT / path  # an absolute path stays itself
    if not p.exists():
        raise ValueError(f"sim.cost.path={path}: no calibration there; run experiments/calibrate/run.py first")
    return json.loads(p.read_text())


def reference_pinned_s(stamp: dict | None) -> float | None:
    """The speed a profile's seconds are expressed at (framework/core/host_probe.pinned's seconds), from its host stamp
    (its ``host_probe``), when experiments/calibrate normalized them to one (``--normalize pinned``); None: they are at
    their host's speed then."""
    stamp = stamp or {}
    return stamp.get("pinned_s") if stamp.get("normalized") == "pinned" else None


def serving_cpu_s(path: str) -> tuple[float, float]:
    """The profile's HTTP worker CPU outside its steps (experiments/calibrate/serving.py): (per request, per answer
    token)."""
    data = read_calibration(path)
    serving, reference = data.get("serving"), reference_pinned_s(data.get("host_probe"))
    if not serving:
        raise ValueError(f"sim.cost.serving=measured: {path} holds no serving measurement; measure it with "
                         f"experiments/calibrate/serving.py, or use sim.cost.serving=none")
    at = serving.get("normalized_to_pinned_s")
    if reference is not None and not (at and math.isclose(at, reference)):
        raise ValueError(f"sim.cost.serving=measured: {path}'s serving measurement is not at its profile's reference "
                         f"speed ({at} against {reference} s): re-measure it with experiments/calibrate/"
                         f"serving.py")
    return serving["request_cpu_s"], serving["token_cpu_s"]


@COST.register("calibrated")
class CalibratedCost(CostModel):
    Config = CalibratedConfig
    cuda_graphs = False             # profiled on this CPU: the engine captures no graph there
    reads_hardware = False          # this machine's engine, as profiled: `hardware=` prices nothing here

    def __init__(self, cfg: CalibratedConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        prof = load_profile(cfg.path, instance)
        pre, dec = prof["prefill"], prof["decode"]
        if cfg.point not in POINTS:
            raise ValueError(f"sim.cost.point={cfg.point!r} is not one of {tuple(POINTS)}")
        key = POINTS[cfg.point]
        if key not in pre or key not in dec:
            raise ValueError(f"sim.cost.point={cfg.point}: the profile {cfg.path} holds only each point's fastest "
                             f"repeat (profiled before medians were kept); re-profile with "
                             f"experiments/calibrate/run.py, or use sim.cost.point=fastest")
        for name, value in (("host_scale", cfg.host_scale), ("host_scale_extend", cfg.host_scale_extend)):
            if value is not None and not value > 0:
                raise ValueError(f"sim.cost.{name}={value} must be > 0 (the host's speed now / at profiling)")
        if cfg.collective_s is not None and not cfg.collective_s > 0:
            raise ValueError(f"sim.cost.collective_s={cfg.collective_s} must be > 0 (one collective's seconds), or "
                             f"null for the profile's own")
        collective = (prof.get("collective_s") if cfg.collective_s is None else cfg.collective_s) or 0.0
        if cfg.host_scale_waits and cfg.collective_s is None:   # the profile's latency, moved with the host (module
            collective *= cfg.host_scale                         # doc); a given collective_s is the host's own now
        counts = prof.get("collectives_per_step", {})          # a step's waits on collectives, by kind
        self._wait_extend, self._wait = counts.get("prefill", 0) * collective, counts.get("decode", 0) * collective
        scale = cfg.host_scale       # every price below follows the measured seconds: scaled here, once
        extend = scale if cfg.host_scale_extend is None else cfg.host_scale_extend
        pre_s, dec_s = ([[s * x for s in row] for row in grid[key]] for grid, x in ((pre, extend), (dec, scale)))
        self.prefill = Fit(PREFILL_TERMS, pre["new"], pre["prefix"], pre_s)
        self.decode = Fit(DECODE_TERMS, dec["batch"], dec["context"], dec_s)
        self._pc, self._dc = self.prefill.coef, self.decode.coef
        if cfg.between not in BETWEEN:
            raise ValueError(f"sim.cost.between={cfg.between!r} is not one of {BETWEEN}")
        if cfg.extend not in EXTEND:
            raise ValueError(f"sim.cost.extend={cfg.extend!r} is not one of {EXTEND}")
        self.per_request = cfg.extend == "per_request"
        if cfg.serving not in SERVING:
            raise ValueError(f"sim.cost.serving={cfg.serving!r} is not one of {SERVING}")
        request_s, token_s = serving_cpu_s(cfg.path) if cfg.serving == "measured" else (0.0, 0.0)
        self._serving = (request_s * scale, token_s * scale)
        self._prefill_time = partial(prefill_time, self._pc)
        self._decode_time = partial(decode_time, self._dc)
        if cfg.between == "grid":  # the measured points, with the fit past them
            self._prefill_time = Grid(pre["new"], pre["prefix"], pre_s, self._prefill_time)
            self._decode_time = Grid(dec["batch"], dec["context"], dec_s, self._decode_time)
        if cfg.prefix_regime not in PREFIX_REGIMES:
            raise ValueError(f"sim.cost.prefix_regime={cfg.prefix_regime!r} is not one of {PREFIX_REGIMES}")
        # absorbed: (no cached prefix, some) -> (price, its fit's coefficients); None: one grid for both
        self._regimes = self._by_regime(pre["new"], pre["prefix"], pre_s, cfg) if cfg.prefix_regime == "absorbed" \
            else None

    def _by_regime(self, new: list, prefix: list, seconds: list[list[float]], cfg: CalibratedConfig) -> tuple:
        """The prefill priced apart for a batch in the normal form (the p = 0 column) and in the absorbed one (the
        cached columns), each with its own fit, read as ``between`` says."""
        if prefix[0] != 0 or len(prefix) < 3:
            raise ValueError(f"sim.cost.prefix_regime=absorbed needs a profile whose prefill grid has a p = 0 column and "
                             f"at least two cached-prefix columns; {cfg.path} has prefixes {list(prefix)}: re-profile "
                             f"with experiments/calibrate/run.py, or use sim.cost.prefix_regime=smooth")
        fresh = Fit(PREFILL_TERMS, new, [0], [row[:1] for row in seconds])
        cached = Fit(PREFILL_TERMS, new, prefix[1:], [row[1:] for row in seconds])
        out = []
        for fit, ys, rows in ((fresh, [0, 1], [row[:1] * 2 for row in seconds]),   # flat in p: only p = 0 is read
                              (cached, prefix[1:], [row[1:] for row in seconds])):
            price = partial(prefill_time, fit.coef)
            out.append((Grid(new, ys, rows, price) if cfg.between == "grid" else price, fit.coef))
        return tuple(out)

    def step_time(self, step: Step) -> float:
        groups, t, wait = len(step.batches), 0.0, self._wait
        for b in step.batches:
            n = len(b.new_tokens)
            if b.mode == "idle" or not n:
                continue
            if b.mode == "decode":
                bt = self._decode_time(groups * n, sum(b.prefix) / n)
            else:
                wait = self._wait_extend          # a step that extends waits on an extend step's collectives
                new = sum(b.new_tokens)
                attended = sum(x * p for x, p in zip(b.new_tokens, b.prefix))
                price, coef = (self._prefill_time, self._pc) if self._regimes is None else \
                    self._regimes[attended > 0]           # absorbed: some request has a cached prefix
                bt = price(new, attended / new)
                if self.per_request and n > 1:
                    bt *= self._per_request_share(new, attended, sum(x * x for x in b.new_tokens), coef)
            t = bt if bt > t else t
        return t + wait if t else t

    def serving_host_s(self) -> tuple[float, float]:
        return self._serving

    def _per_request_share(self, new: int, attended: int, squares: int, c: list[float]) -> float:
        """The fit's price (coefficients ``c``) of a batch attended request by request over its price as one request
        of the same tokens."""
        whole = prefill_time(c, new, attended / new)
        return (whole - c[3] * (new * new - squares)) / whole if whole > 0 else 1.0

    def decode_times(self, sizes: tuple[int, ...], contexts: tuple[int, ...], k: int,
                     graph: bool = False, outputs: tuple[int, ...] | None = None) -> list[float]:
        """As step_time would price each step of the run (the same arithmetic), without building the steps."""
        groups, price = len(sizes), self._decode_time
        busy = [(groups * n, n, c) for n, c in zip(sizes, contexts) if n]
        wait = self._wait
        if len(busy) == 1:
            (b, n, c), = busy
            return [price(b, (c + j * n) / n) + wait for j in range(k)]
        return [max(price(b, (c + j * n) / n) for b, n, c in busy) + wait for j in range(k)]
