"""Soak: a router in service for a long time, compressed. Does each policy's state follow the workers' caches, stay
bounded, and keep its decisions cheap, window after window?

    python experiments/soak/run.py [--cycles 3] [--routers sticky_prefix cache_aware ...] [--quick]

mode=sim (framework/sim): one router and 4 simulated workers (the routing study's: 6 MB of KV each, 8-token KV
blocks) live through a schedule of windows. Each window plays one trace to the end (an agent trace, A: 24 sessions of
10 steps behind 4 shared tool prefixes; or, after the mix changes, B: 32 conversations of 6 turns); between windows
the operator acts on the cluster, as a long-lived service sees it:

    flush        every worker's POST /flush_cache (its radix cache emptied: the router hears AllBlocksCleared when
                 its policy follows the KV events, nothing otherwise, as with SGLang's router)
    kill         a worker dies and the supervisor restarts it: removed from the router, a cold process, added back
    restart      a worker restarts in place (its KV event sequence starts over: the router resets it, RESTARTED)
    add / remove a fifth worker joins, later leaves
    mix          the traffic changes from A to B (and back)

One cycle is 12 windows; ``--cycles`` repeats it (the default 3: 36 windows, 13-27 minutes of simulated service per
policy, ~14 minutes of wall time for all of them on the shared 2-core machine; more cycles, longer service). The windows marked ``same`` replay trace A after a flush on the original 4 workers: their hit
rate and TTFT p99 must not drift down over the run (``drift`` in the table: the last such window's against the
first's), and the router's memory (``state_sizes``: entries per structure) must stay bounded (``state max/first``).

Per window: hit rate (the workers' cached tokens over prompt tokens), TTFT p99 (simulated), the policy's entries,
and the decision time (p50 / p99 of the real CPU time of ``dispatch`` in this process: the simulator runs the real
policy object). Prints a table, writes results.json and one plot per policy (plots/<router>.png).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.contracts.routing import RESTARTED  # noqa: E402
from framework.core.registry import WORKLOAD  # noqa: E402
from framework.report.metrics import summarize  # noqa: E402
from framework.runs.sim import build, cost_model  # noqa: E402
from framework.sim.cluster import Simulation  # noqa: E402
from framework.sim.instance import SimInstance  # noqa: E402

# every router configuration (conf/router), and servelab's switch that lets SGLang's tree hear a flush
CONTENDERS = {**{p.stem: [f"router={p.stem}"] for p in sorted((ROOT / "conf" / "router").glob("*.yaml"))},
              "cache_aware_v2+follow_flushes": ["router=cache_aware_v2", "router.follow_flushes=true"]}
BASE = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "cluster.instances=4", "engine.kv_budget_mb=6",
        "cluster.kv_block_size=8", "cluster.kv_events=true", "seed=0"]
TRACES = {
    "A": ["workload=agent", "workload.num_sessions=24", "workload.steps=10", "workload.max_concurrency=16"],
    "B": ["workload=multi_turn", "workload.num_conversations=32", "workload.turns=6", "workload.system_prompt_len=16",
          "workload.user_len=96", "workload.output_len=8", "workload.max_concurrency=16"],
}
QUICK = {"A": ["workload.num_sessions=8", "workload.steps=4"], "B": ["workload.num_conversations=8", "workload.turns=3"]}
# (what the operator did before the window, the trace it plays); "same": trace A after a flush on the 4 workers
CYCLE = [("start", "A"), ("flush", "A"), ("kill", "A"), ("add", "A"), ("remove", "A"), ("flush same", "A"),
         ("restart", "A"), ("mix", "B"), ("flush", "B"), ("kill", "B"), ("mix", "A"), ("flush same", "A")]
GAP_S = 5.0  # simulated seconds between windows


class Service:
    """One router and its workers, living through the windows."""

    def __init__(self, router: str, quick: bool):
        self.cfgs = {}
        for trace, overrides in TRACES.items():
            extra = CONTENDERS[router] + overrides + (QUICK[trace] if quick else [])
            cfg = compose(BASE + extra)
            if "block_size" in cfg.router.__dataclass_fields__:
                cfg = compose(BASE + extra + ["router.block_size=8"])
            self.cfgs[trace] = cfg
        self.sessions = {t: WORKLOAD.build(c.workload.name, c.workload, c.seed).sessions() for t, c in self.cfgs.items()}
        cfg = self.cfgs["A"]
        self.cost = cost_model(cfg)
        self.sim = build(cfg, self.sessions["A"], cost=self.cost)
        self.router, self.instances = self.sim.router, self.sim.instances
        self.core = self.router.core
        self.start = 0.0
        self.extra = 0  # workers added so far (their names)

    def _new_instance(self, name: str) -> SimInstance:
        inst = SimInstance(name, self.cfgs["A"], self.cost, self.cfgs["A"].seed)
        self.router.watch(name, [g.cache for g in inst.groups])
        return inst

    def act(self, what: str, k: int) -> str:
        """The operator's action before window ``k``; returns what it did, in words."""
        names = sorted(self.instances)
        if what.startswith("flush"):
            for inst in self.instances.values():
                for g in inst.groups:
                    g.cache.reset()
            return "flushed every worker"
        if what == "kill":
            name = names[k % len(names)]
            self.core.remove_worker(name)
            self.instances[name] = self._new_instance(name)
            self.core.add_worker(name, healthy=True)
            return f"{name} killed, restarted cold, added back"
        if what == "restart":
            name = names[k % len(names)]
            self.instances[name] = self._new_instance(name)
            self.core.reset_worker(name, RESTARTED)
            return f"{name} restarted in place"
        if what == "add":
            self.extra += 1
            name = f"sim://extra-{self.extra}"
            self.instances[name] = self._new_instance(name)
            self.core.add_worker(name, healthy=True)
            return f"{name} added"
        if what == "remove":
            name = f"sim://extra-{self.extra}"
            self.core.remove_worker(name)
            del self.instances[name]
            return f"{name} removed"
        return what

    def window(self, trace: str) -> dict:
        cfg, sessions = self.cfgs[trace], self.sessions[trace]
        shifted = [dataclasses.replace(s, arrival_s=s.arrival_s + self.start) for s in sessions]
        sim = Simulation(self.instances, self.router, shifted, cfg.workload, self.sim.tokenizer,
                         network_s=self.sim.net, router_s=self.sim.router_s, fast_forward=self.sim.ff, itl=False)
        self.core.stats.reset()
        cpu0 = time.process_time()
        records, end = sim.run()
        cpu = time.process_time() - cpu0
        stats = self.core.snapshot()
        for r in records:
            r.send_s -= self.start  # relative to the window (summarize's duration)
        summary = summarize(records, end - self.start, cfg.workload.slo)
        self.start = end + GAP_S
        state = stats["policy_state"]
        return {"requests": len(records), "failed": sum(not r.ok for r in records),
                "hit_rate": summary["cache_hit_rate"], "ttft_p99_ms": summary["ttft_p99_ms"],
                "estimated_hit_rate": stats["estimated_hit_rate"], "reasons": stats["reasons"],
                "state_entries": sum(state.values()), "state": state,
                "decision_p50_us": stats["router_decision_us"]["p50"],
                "decision_p99_us": stats["router_decision_us"]["p99"],
                "workers": len(self.instances), "sim_end_s": end, "sim_cpu_s": cpu}


def soak(router: str, cycles: int, quick: bool) -> list[dict]:
    service, rows = Service(router, quick), []
    for k, (what, trace) in enumerate(CYCLE * cycles):
        did = service.act(what.split()[0] if what != "start" else "start", k) if k else "fresh router, cold workers"
        row = {"router": router, "window": k, "action": did, "trace": trace, "same": what.endswith("same"),
               **service.window(trace)}
        rows.append(row)
        print(f"  {router:15s} w{k:<3d} {trace} {row['hit_rate']:.3f} ttft p99 {row['ttft_p99_ms']:8.0f} ms "
              f"entries {row['state_entries']:7d} decision p50 {row['decision_p50_us']:6.1f} us  ({did})", flush=True)
    return rows


def verdict(rows: list[dict]) -> dict:
    same = [r for r in rows if r["same"]]
    entries = [r["state_entries"] for r in rows]
    first_half = entries[:len(entries) // 2] or entries
    return {"router": rows[0]["router"], "windows": len(rows), "same_windows": len(same),
            "hit_first_same": same[0]["hit_rate"], "hit_last_same": same[-1]["hit_rate"],
            "hit_drift": same[-1]["hit_rate"] - same[0]["hit_rate"],
            "hit_same_min": min(r["hit_rate"] for r in same),
            "ttft_p99_first_same_ms": same[0]["ttft_p99_ms"], "ttft_p99_last_same_ms": same[-1]["ttft_p99_ms"],
            "state_max_second_half_over_first_half": (max(entries[len(entries) // 2:]) / max(max(first_half), 1)),
            "decision_p50_us_median": statistics.median(r["decision_p50_us"] for r in rows),
            "decision_p50_us_last_over_first": rows[-1]["decision_p50_us"] / max(rows[0]["decision_p50_us"], 1e-9),
            "simulated_s": rows[-1]["sim_end_s"], "failed": sum(r["failed"] for r in rows)}


def table(verdicts: list[dict]) -> str:
    head = ("| router | windows | hit (same) first | last | drift | TTFT p99 first ms | last ms | state max 2nd/1st half "
            "| decision p50 us | p50 last/first | simulated s |")
    lines = [head, "|" + "---|" * 11]
    for v in verdicts:
        lines.append(f"| {v['router']} | {v['windows']} | {v['hit_first_same']:.3f} | {v['hit_last_same']:.3f} | "
                     f"{v['hit_drift']:+.3f} | {v['ttft_p99_first_same_ms']:.0f} | {v['ttft_p99_last_same_ms']:.0f} | "
                     f"{v['state_max_second_half_over_first_half']:.2f} | {v['decision_p50_us_median']:.1f} | "
                     f"{v['decision_p50_us_last_over_first']:.2f} | {v['simulated_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routers", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small traces, one cycle: a smoke run")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    cycles = 1 if args.quick else args.cycles
    t0 = time.time()
    rows, verdicts = [], []
    for router in args.routers:
        got = soak(router, cycles, args.quick)
        rows += got
        verdicts.append(verdict(got))
    print(table(verdicts))
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"mode": "sim", "cycles": cycles, "contenders": {r: CONTENDERS[r] for r in args.routers}, "quick": args.quick, "cycle": CYCLE, "base": BASE,
           "traces": {t: o + (QUICK[t] if args.quick else []) for t, o in TRACES.items()},
           "verdicts": verdicts, "windows": rows, "wall_s": time.time() - t0}
    (args.out / "results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    from plot import plot_router  # matplotlib only here
    for router in args.routers:
        plot_router([r for r in rows if r["router"] == router], args.out / "plots")
    print(f"results: {args.out / 'results.json'}  ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
