"""The exact-view policies' decision time against cache_aware's, measured as the HTTP router measures it, without a
cluster: the soak's real run (real.py: tests/sim/test_policy_state_replay.py's agent trace, 4 workers, 8-token blocks,
the workers flushed before each replay) played in mode=sim, each request given to the router core as its text only (as
the HTTP router gives it: the policy tokenizes), timed by the core's own timer (``RouterCore.dispatch``,
``router_stats``' ``router_decision_us``). A decision runs after the simulator's work, cold, as it does after the
router's event loop: this reproduces the HTTP router's gap (a warm in-process loop, bench_decisions.py, shows half of it).

    python experiments/soak/decision_yardstick.py [--runs 5] [--replays 2] [--routers ...] [--against /tmp/base]
                                                  [--record DIR | --compare DIR DIR | --opcodes | --parts]

Each run is a fresh process per router (and per tree), interleaved; prints each run's p50 (``router_decision_us``'
p50 over the replays' decisions), then per tree the median over runs with its ratio to cache_aware's; writes
results_yardstick.json (``--out``). ``--tree``: time another checkout's code; ``--against``: a second checkout (a copy
of HEAD: before/after), alternated with the first run by run. ``--record DIR``: each router's decisions of one run
(worker, reason, estimate, request length, memo; PYTHONHASHSEED fixed so block keys repeat), to compare two trees'
decisions (pickles; equal lists = the same decisions): ``--compare DIR DIR``. ``--opcodes``: each decision's Python
opcodes instead (traced, untimed; what other jobs on the machine do not blur), with the mean per function.
``--parts``: where an exact-view decision's time goes, in place (each part's p50 by its own timer: the prompt's keys, of which the hashing of its new
blocks, the match, the credit, the record; each timer adds ~0.2 us to ``dispatch``).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = ["cache_aware", "precise_prefix", "sticky_prefix", "kv_cost"]


def time_parts() -> dict[str, list[int]]:
    """Timers (ns) around the parts of an exact-view decision, patched in place. The hashing is timed only inside a
    request's keys: events hash their blocks too."""
    from framework.kv_events.hashing import BlockKeys
    from framework.routing.core import RouterCore
    from plugins.routing.lib.kv_policy import KvViewPolicy
    parts: dict[str, list[int]] = {}
    in_keys = [False]
    clock = time.perf_counter_ns

    def timed(cls, name: str, part: str, is_keys: bool = False, in_keys_only: bool = False) -> None:
        f, times = getattr(cls, name), parts.setdefault(part, [])

        def g(*a, **k):
            if in_keys_only and not in_keys[0]:
                return f(*a, **k)
            in_keys[0] |= is_keys
            t = clock()
            try:
                return f(*a, **k)
            finally:
                times.append(clock() - t)
                in_keys[0] &= not is_keys
        setattr(cls, name, g)
    timed(BlockKeys, "chain", "hashing", in_keys_only=True)
    timed(KvViewPolicy, "blocks", "keys", is_keys=True)  # the memo's lookup and update, or (C keys) the whole prompt
    for name in ("match", "credit", "decision"):
        timed(KvViewPolicy, name, name)
    timed(RouterCore, "dispatch", "dispatch")
    return parts


def child(router: str, replays: int, record: str | None, opcodes: bool, parts: bool = False) -> None:
    """One router over the trace (run in the tree to time, ``cwd``): prints its decision times as JSON (``opcodes``:
    the Python opcodes of each ``dispatch`` instead, traced, so untimed; ``parts``: each part's p50, us)."""
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.join(os.getcwd(), "tests", "sim"))
    import test_policy_state_replay as replay  # the operator's replay scenario: its trace and cluster
    from framework.sim.router import SimRouter

    def send(self, text, token_ids, now, max_new_tokens=None):  # as the HTTP router: the text only
        self.now = now
        att = self.core.dispatch(text)
        return att, self.core.hold(att)

    SimRouter.send = send
    decisions, times, counts = [], [], []
    from framework.routing.core import RouterCore
    dispatch = RouterCore.dispatch
    if opcodes:
        sys.path.insert(0, str(ROOT / "experiments" / "bench_router"))
        from bench_decisions import opcode_tracer
        tracer = opcode_tracer()

        def traced(self, *a, **k):
            tracer.count = 0
            sys.settrace(tracer)
            try:
                return dispatch(self, *a, **k)
            finally:
                sys.settrace(None)
                counts.append(tracer.count)
        RouterCore.dispatch = traced
    if record:

        def recorded(self, *a, **k):
            att = dispatch(self, *a, **k)
            d = att.decision
            memo = d.memo._asdict() if hasattr(d.memo, "_asdict") else d.memo
            if isinstance(memo, dict):
                memo = {k: tuple(v) if isinstance(v, list) else v for k, v in memo.items()}
            decisions.append((d.worker, d.reason, d.matched_chars, d.request_chars, repr(memo)))
            return att
        RouterCore.dispatch = recorded
    timers = time_parts() if parts else None
    import framework.sim.cluster as cluster
    run = cluster.Simulation.run

    def timed_run(self):  # each replay's decision times, read before the next replay's Simulation
        out = run(self)
        stats = self.router.core.stats
        times.extend(stats.decision_us)
        stats.decision_us.clear()
        return out
    cluster.Simulation.run = timed_run
    replay.replays(replay.config(router), replays)
    if record:
        with open(record, "wb") as f:
            pickle.dump(decisions, f)
    if timers is not None:
        print(json.dumps({"router": router, "us": {k: statistics.median(v) / 1e3 for k, v in timers.items() if v}}))
        return
    if opcodes:   # per decision, and per function over all of them (where the interpreter's work goes)
        by = {k: v / len(counts) for k, v in tracer.by_function.most_common(12)}
        print(json.dumps({"router": router, "us": {"per_decision": counts, "by_function": by}}))
        return
    print(json.dumps({"router": router, "us": times}))


def one(tree: Path, router: str, replays: int, record: str | None = None, opcodes: bool = False,
        parts: bool = False) -> list[float] | dict[str, float]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", router, "--replays", str(replays)]
    if record:
        cmd += ["--record", record]
    if opcodes:
        cmd += ["--opcodes"]
    if parts:
        cmd += ["--parts"]
    out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["us"]


def compare(a: str, b: str) -> None:
    """Per router recorded in both folders: the same decisions, or the first that differs."""
    for name in sorted(set(os.listdir(a)) & set(os.listdir(b))):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            x, y = pickle.load(fa), pickle.load(fb)
        first = next((i for i, (d, e) in enumerate(zip(x, y)) if d != e), None)
        same = first is None and len(x) == len(y)
        print(f"{name[:-4]}: {len(x)} / {len(y)} decisions, " + ("the same" if same else f"differ from #{first}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--replays", type=int, default=2)
    ap.add_argument("--routers", nargs="+", default=ROUTERS)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code is timed")
    ap.add_argument("--against", type=Path, help="another checkout, timed run by run alternately (before/after)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results_yardstick.json"))
    ap.add_argument("--record", help="a folder: write each router's decisions there (one run, untimed use)")
    ap.add_argument("--compare", nargs=2, metavar="DIR", help="two --record folders: are the decisions the same?")
    ap.add_argument("--opcodes", action="store_true", help="count each decision's Python opcodes instead (one run)")
    ap.add_argument("--parts", action="store_true", help="each part's p50 of an exact-view decision, in place")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.replays, args.record, args.opcodes, args.parts)
    if args.parts:
        trees = {"this": args.tree, **({"against": args.against} if args.against else {})}
        for k in range(args.runs):  # alternated, as the timed runs
            for t, tree in trees.items():
                for r in args.routers:
                    if r != "cache_aware":
                        us = one(tree, r, args.replays, parts=True)
                        print(f"run {k + 1} {t} {r}: " + "  ".join(f"{p} {v:.1f}" for p, v in us.items()), flush=True)
        return
    if args.opcodes:
        trees = {"this": args.tree, **({"against": args.against} if args.against else {})}
        for t, tree in trees.items():
            for r in args.routers:
                ops = one(tree, r, args.replays, opcodes=True)
                print(f"{t} {r}: opcodes per decision, p50 {statistics.median(ops['per_decision']):.0f}; mean per "
                      "function: " + ", ".join(f"{f} {n:.0f}" for f, n in ops["by_function"].items()), flush=True)
        return
    if args.compare:
        return compare(*args.compare)
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        for router in args.routers:
            one(args.tree, router, args.replays, os.path.join(os.path.abspath(args.record), f"{router}.pkl"))
        print(f"decisions of {args.routers} in {args.record}")
        return
    trees = {"this": args.tree, **({"against": args.against} if args.against else {})}
    p50s = {(t, r): [] for t in trees for r in args.routers}
    for k in range(args.runs):  # the trees and the routers interleaved: the same minutes of a noisy machine
        for t, tree in trees.items():
            for router in args.routers:
                p50s[t, router].append(statistics.median(one(tree, router, args.replays)))
            print(f"run {k + 1} {t}: " + "  ".join(f"{r} {p50s[t, r][-1]:.1f}" for r in args.routers), flush=True)
    rows = []
    for t, tree in trees.items():
        print(f"\n{t} ({tree}): decision p50 us, median over {args.runs} runs; ratio to cache_aware's (of the medians, "
              f"and the median of the run-by-run ratios)")
        print("| router | p50 us | runs | ratio | run-by-run ratio |")
        print("|---|---:|---|---:|---:|")
        base = p50s.get((t, "cache_aware"))
        for r in args.routers:
            runs = p50s[t, r]
            med = statistics.median(runs)
            ratio = med / statistics.median(base) if base else None
            per_run = statistics.median(x / y for x, y in zip(runs, base)) if base else None
            rows.append({"tree": t, "router": r, "p50_us": med, "runs_p50_us": runs, "ratio": ratio,
                         "run_by_run_ratio": per_run})
            print(f"| {r} | {med:.1f} | {', '.join(f'{x:.0f}' for x in runs)} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} | {'-' if per_run is None else f'{per_run:.2f}'} |")
    args.out.write_text(json.dumps({"trees": {t: str(p) for t, p in trees.items()}, "replays": args.replays,
                                    "runs": args.runs, "rows": rows}, indent=1) + "\n")

if __name__ == "__main__":
    main()
