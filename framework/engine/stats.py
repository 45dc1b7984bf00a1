"""One statistics builder, one name per figure.

Three levels, each built from the one below, whatever ran it (in-process or behind HTTP, one rank or many):

- a rank's snapshot: `Engine.server_info()` (load, KV, memory, its scheme, step counters, timing, expert counts);
- an instance's stats (`instance_stats`): what `EngineHandle.stats()` and `close()` return and a worker serves at
  /get_server_info. The ranks of one DP group hold copies of one scheduler's state, so its leader counts it once;
- a run's engine figures (`engine_figures`): results.json's keys for one or many instances, counters taken over
  the run (after - before), so `cluster.http=true` and `false` report the same keys for the same config.
"""
from __future__ import annotations

from typing import Any

from framework.contracts.batch import ForwardMode
from framework.engine.cuda_graph import GRAPH_COUNTERS
from framework.model.moe_stats import PLACEMENT_KEYS, combine_rank_counts, load_stats

SCHEME = "scheme_keys"   # the keys of the parallelism plugin's describe() (what ran), passed through whole
STATIC_KEYS = ("kv_sizing", "weight_bytes_per_rank", "kv_bytes_per_token_per_rank", "kv_capacity_tokens_per_rank",
               "kv_capacity_tokens_instance")
GROUP_LOAD_KEYS = ("running_requests", "queued_requests", "kv_used_tokens", "cache_tokens")
GROUP_COUNTERS = ("retractions", "extend_steps", "decode_steps",             # one scheduler per DP group
                  "cache_hit_tokens", "cache_prefill_tokens", "engine_ttft_s", "first_tokens")
# every rank's own; the step CPU keys: the rank's CPU seconds in steps by kind (step_cpu_key); in the simulator, the
# cost model's priced seconds of those steps (what the step costs a host to itself)
STEP_CPU_KEYS = ("extend_cpu_s", "decode_cpu_s")
RANK_COUNTERS = ("idle_steps", "skipped_idle_steps", "schedule_s", "forward_s", *STEP_CPU_KEYS)
# the same on every rank: rank 0's (graph counters: every rank replays the same steps; under DP attention the eager
# reason is rank 0's own, e.g. `disagree` where the rank in extend counts `mode`)
STEP_COUNTERS = ("steps", "graph_eligible_steps", *GRAPH_COUNTERS)
RUN_COUNTERS = ("retractions", "steps", "idle_steps", "graph_eligible_steps", *GRAPH_COUNTERS, "schedule_s",
                "forward_s", *STEP_CPU_KEYS)


def step_cpu_key(batches) -> str:
    """Which step CPU key a rank's step counts under: extend_cpu_s when a batch of its DP group(s) extends (a
    mixed step too), else decode_cpu_s (DECODE, or IDLE joining another group's step)."""
    return "extend_cpu_s" if any(b.mode is ForwardMode.EXTEND for b in batches) else "decode_cpu_s"


def rank_snapshot(scheduler, scheme: dict, rank: int, dp_rank: int, leads: bool, memory, requests: int,
                  counters: dict, expert_counts: dict | None = None, expert_counts_local: bool = False) -> dict:
    """A rank's snapshot, from its scheduler and what the caller counts (`counters`: the parallelism plugin's step
    counters and the timing); the engine's ranks and the simulator's alike. `memory`: the rank's MemoryPlan."""
    s = scheduler
    return {**scheme, SCHEME: list(scheme), "rank": rank, "dp_rank": dp_rank, "leads": leads,
            "running_requests": s.num_running(), "queued_requests": len(s.waiting),
            "kv_capacity_tokens_per_rank": s.pool.capacity, "kv_used_tokens": s.pool.used(),
            "cache_tokens": s.cache.total_size(), "kv_bytes_per_token_per_rank": memory.kv_bytes_per_token,
            "kv_sizing": memory.sizing, "weight_bytes_per_rank": memory.weight_bytes_total,
            "requests": requests, **s.stats, **counters, "hit_rate_points": list(s.hit_log.points),
            "expert_counts": expert_counts or {}, "expert_counts_local": expert_counts_local}


def instance_stats(ranks: list[dict], peak_running: int | None = None) -> dict[str, Any]:
    """An instance's stats from its ranks' snapshots (rank order). `peak_running`: the most requests running at
    once over the instance's DP groups, as rank 0 saw them step by step (default: the one group's own peak)."""
    leaders = [r for r in ranks if r["leads"]]
    first = ranks[0]
    per_rank = min(r["kv_capacity_tokens_per_rank"] for r in ranks)
    out = {k: first[k] for k in first[SCHEME]}
    out.update({
        SCHEME: first[SCHEME],
        "kv_sizing": first["kv_sizing"],
        "weight_bytes_per_rank": max(r["weight_bytes_per_rank"] for r in ranks),
        "kv_bytes_per_token_per_rank": first["kv_bytes_per_token_per_rank"],
        "kv_capacity_tokens_per_rank": per_rank,
        "kv_capacity_tokens_instance": per_rank * len(leaders),
        **{k: sum(r[k] for r in leaders) for k in GROUP_LOAD_KEYS + GROUP_COUNTERS},
        "max_running_requests": first["max_running_requests"] if peak_running is None else peak_running,
        **{k: sum(r[k] for r in ranks) for k in RANK_COUNTERS},
        **{k: first[k] for k in STEP_COUNTERS},
        "requests_per_rank": [r["requests"] for r in ranks],
        "hit_rate_points": [r.get("hit_rate_points", []) for r in leaders],     # one series per scheduler
        "expert_counts": combine_rank_counts([(r["expert_counts"], r["expert_counts_local"]) for r in ranks]),
        # EPLB's re-placements (a MoE backend's `stats`): every rank derives the same moves, so rank 0's are the
        # instance's
        **{k: first[k] for k in PLACEMENT_KEYS if k in first},
        # the collectives rank 0 waited on (the engine's ranks; every rank of a step joins the same ones)
        **({"collectives": first["collectives"]} if "collectives" in first else {}),
    })
    return out


def engine_figures(before: list[dict], after: list[dict], start: float | None = None) -> dict[str, Any]:
    """results.json's engine keys for instances of one config: `after[i]` and `before[i]` are instance i's stats at
    the end and at the start of the run ({} for a fresh instance). The largest batch is since the instance started.
    `start`: when the run began on the engines' clock (hit-rate series times count from it; default: from the
    run's first prefill)."""
    pairs = [(b, a) for b, a in zip(before, after) if "kv_sizing" in a]   # not a failed or external server
    if not pairs:
        return {}
    first = pairs[0][1]

    def delta(key: str) -> float:
        return sum(a[key] - b.get(key, 0) for b, a in pairs)
    out = {k: first[k] for k in (*first.get(SCHEME, ()), *STATIC_KEYS) if k in first}
    out["max_running_requests"] = max(a["max_running_requests"] for _, a in pairs)
    out.update({k: delta(k) for k in RUN_COUNTERS if k not in ("schedule_s", "forward_s")})
    out["graph_eligible_frac"] = out["graph_eligible_steps"] / max(out["steps"], 1)
    if all("server_process_cpu_s" in a for _, a in pairs):   # HTTP workers: their processes' CPU over the run
        out["server_process_cpu_s"] = delta("server_process_cpu_s")
    busy = delta("schedule_s") + delta("forward_s")
    out["scheduler_overhead_frac"] = delta("schedule_s") / busy if busy > 0 else 0.0
    out["requests_per_rank"] = [sum(col) for col in zip(*(
        [n - m for n, m in zip(a["requests_per_rank"], b.get("requests_per_rank", [0] * len(a["requests_per_rank"])))]
        for b, a in pairs))]
    out.update(load_stats(_expert_deltas(pairs), first.get("parallel_size", 1)))
    out.update({k: delta(k) for k in PLACEMENT_KEYS if k in first})
    out.update(hit_rate_figures(pairs, start))
    if all("first_tokens" in a for _, a in pairs):     # the TTFT's part in the engines: arrival to first token
        firsts = delta("first_tokens")
        out["engine_ttft_ms_mean"] = delta("engine_ttft_s") / firsts * 1e3 if firsts else float("nan")
    return out


class HitRateLog:
    """SGLang v0.4's cache hit rate, as Scheduler.log_prefill_stats computes it (tree_cache_metrics): per scheduler,
    cumulative since it started, token-weighted: the prompt tokens its prefill batches found cached over those plus
    the tokens they ran. A request's first chunk counts its cached prefix, a later chunk none (PrefillAdder's
    add_being_chunked_req), a retracted request counts again when it is prefilled again. The counters live in the
    scheduler's `stats` (cache_hit_tokens, cache_prefill_tokens, the latter without the hits); `points` samples
    (time, hit, hit + prefill) at the end of a prefill step (SGLang logs as the batch forms, one step earlier),
    thinned to at most MAX_POINTS by keeping every other point."""
    MAX_POINTS = 256

    def __init__(self, stats: dict):
        self.stats, self.points = stats, []
        self._due, self._count, self._every = False, 0, 1

    def prefill(self, reqs, continued) -> None:
        """A prefill batch formed of `reqs`; `continued`: the request whose next chunk it runs (or None)."""
        self.stats["cache_hit_tokens"] += sum(len(r.prefix_indices) for r in reqs if r is not continued)
        self.stats["cache_prefill_tokens"] += sum(r.extend_input_len for r in reqs)
        self._due = True

    def stamp(self, now: float) -> None:
        """The prefill step ended at `now`: sample the counters."""
        if not self._due:
            return
        self._due, self._count = False, self._count + 1
        if self._count % self._every:
            return
        hit = self.stats["cache_hit_tokens"]
        self.points.append((now, hit, hit + self.stats["cache_prefill_tokens"]))
        if len(self.points) > self.MAX_POINTS:
            self.points, self._every = self.points[1::2], self._every * 2


def _rate(hit: float, total: float) -> float:
    return hit / total if total else 0.0


def hit_rate_figures(pairs: list[tuple[dict, dict]], start: float | None) -> dict[str, Any]:
    """SGLang's hit rate at the end of the run (all schedulers' tokens together, and per instance: cumulative since
    each started, as SGLang's log shows it, warm-up and earlier runs on the same instances included), the same over
    this run's prefills only (`_run`), and over time: per instance, one [[t_s, rate], ...] per scheduler."""
    if not all("cache_hit_tokens" in a for _, a in pairs):
        return {}
    hit = sum(a["cache_hit_tokens"] for _, a in pairs)
    total = hit + sum(a["cache_prefill_tokens"] for _, a in pairs)
    if start is None:                     # the run's first prefill: the first point newer than every `before` one
        old = max((p[0] for b, _ in pairs for s in b.get("hit_rate_points", []) for p in s), default=float("-inf"))
        new = [p[0] for _, a in pairs for s in a["hit_rate_points"] for p in s if p[0] > old]
        start = min(new, default=0.0)
    run_hit = hit - sum(b.get("cache_hit_tokens", 0) for b, _ in pairs)       # this run's own tokens only
    run_total = total - sum(b.get("cache_hit_tokens", 0) + b.get("cache_prefill_tokens", 0) for b, _ in pairs)
    return {"sglang_cache_hit_rate": _rate(hit, total), "sglang_cache_hit_rate_run": _rate(run_hit, run_total),
            "sglang_cache_hit_rate_per_instance": [
                _rate(a["cache_hit_tokens"], a["cache_hit_tokens"] + a["cache_prefill_tokens"]) for _, a in pairs],
            "sglang_cache_hit_rate_series": [[[[t - start, _rate(h, n)] for t, h, n in s] for s in a["hit_rate_points"]]
                                             for _, a in pairs]}


def crossing_time(series: list[list[float]], level: float) -> float | None:
    """The first time a [[t, rate], ...] series reaches `level`, linearly between samples (None: never)."""
    prev = None
    for t, rate in series:
        if rate >= level:
            if prev is None or prev[1] >= level:
                return t
            (t0, r0) = prev
            return t0 + (t - t0) * (level - r0) / (rate - r0)
        prev = (t, rate)
    return None


def _expert_deltas(pairs: list[tuple[dict, dict]]) -> dict[int, list[int]]:
    """Routed slots per expert of each MoE layer during the run, summed over the instances (JSON turns the layer
    keys into strings: both are read)."""
    total: dict[int, list[int]] = {}
    for before, after in pairs:
        start = {int(k): v for k, v in before.get("expert_counts", {}).items()}
        for layer, counts in after["expert_counts"].items():
            layer = int(layer)
            old = start.get(layer, [0] * len(counts))
            acc = total.setdefault(layer, [0] * len(counts))
            total[layer] = [t + c - s for t, c, s in zip(acc, counts, old)]
    return total
