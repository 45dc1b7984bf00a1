"""How long does one routing decision take? (the router's CPU cost per request, no HTTP)

Workload: 200 conversations x 50 turns (10,000 requests, seeded). Each conversation starts from one of 4 shared system
prompts; every request is the whole conversation so far (system prompt, earlier user/assistant turns, the new user
turn), built from random words so that prefixes branch where real ones do. Conversations advance in a random
interleaving; 64 requests are kept in flight (the oldest completes when a new one is sent) so the load balance rule
sees realistic counts. Each decision is timed alone (match + select + insert for cache_aware).

Columns: median / p99 / mean wall time of one ``select``; "cpu us" is the whole loop's CPU time per request
(select, timers and bookkeeping), which other processes on a shared machine do not inflate; the last table adds each
decision's own CPU time (p50 / p99): a wall p99 far above the CPU p99 is decisions that waited for a core. Each
policy runs ``--repeats`` times on a fresh policy and the run with the lowest median is reported (timeit's
convention), with the spread of the medians over the repeats.

The yardstick (``plain_tree``, plain_tree.py): a plain ~100-line pure-Python radix tree making the same cache-aware
decisions (one dict of children per node, tenant stamps, no eviction queue, no undo). It runs alternately with
cache_aware, repeat by repeat, on the same requests in the same process, and must pick the same worker for every
request (checked); "x plain" is cache_aware's median over the plain tree's in the same repeat (median and range over
the repeats). PYTHONPATH must reach the repository root (``PYTHONPATH=. python experiments/...``) when another
checkout of servelab is installed in the environment.

The exact-view policies (precise_prefix, sticky_prefix, kv_cost: conf/router's presets) route on the workers' KV
events, so each worker is a real RadixCache of ``--cache-tokens`` slots whose events (framework/kv_events/emitter.py)
reach the policy as a worker's would: a request's blocks are stored when it ends, just before the router hears of its
end, and the least recently used leaves are evicted past the cache's size. cache_aware runs once more in that same loop
(``cache_aware_fed``: the caches' upkeep between decisions cools the CPU caches a decision reads; it ignores the
events), and the last table puts each exact-view policy's p50 / p99 beside cache_aware's, both ways, with the ratios
(issue 25: within 2x), the p50 ratio also taken repeat by repeat (the same moment of a noisy machine). The HTTP router
times ``select`` only (framework/routing/core.py ``dispatch``), for every policy alike; a policy's bookkeeping at a
request's end (``on_request_done``: the exact view retires the request's credited blocks) is outside that timer, so
the next table times it too: release p50 and select + release p50 per request, beside cache_aware_fed's. A last pass
(``--opcodes N``, untimed) counts the Python opcodes of each of the first N decisions of those policies and of
cache_aware in their loop: the interpreter's work per decision (and per release), which other jobs on the machine do not blur.

Eviction: the tree built by the run (~1.8 M characters) is evicted down to half of the mean per-worker size, off the
request path, as ``maintain`` does every ``eviction_interval_secs``.

    python experiments/bench_router/bench_decisions.py [--conversations 200 --turns 50 --workers 4 --seed 0]
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from framework.config import compose
from framework.core.registry import ROUTING
from framework.engine.radix_cache import RadixCache
from framework.kv_events.emitter import CacheEventEmitter
from plain_tree import PlainCacheAware

OUT = Path(__file__).with_name("results_decisions.json")


def make_vocabulary(rng: random.Random, size: int = 3000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(size)]


def sentence(rng: random.Random, vocab: list[str], n_chars: int) -> str:
    words, total = [], 0
    while total < n_chars:
        w = rng.choice(vocab)
        words.append(w)
        total += len(w) + 1
    return " ".join(words)


def multi_turn_workload(conversations: int, turns: int, seed: int, system_prompts: int = 4,
                        system_chars: int = 1500, user_chars: int = 60, assistant_chars: int = 100) -> list[str]:
    """Requests in arrival order; request k of a conversation is its whole text up to the k-th user turn."""
    rng = random.Random(seed)
    vocab = make_vocabulary(rng)
    systems = [f"system: {sentence(rng, vocab, system_chars)}\n" for _ in range(system_prompts)]
    history = [rng.choice(systems) for _ in range(conversations)]
    remaining = [turns] * conversations
    active = list(range(conversations))
    requests = []
    while active:
        i = rng.randrange(len(active))
        c = active[i]
        request = f"{history[c]}user: {sentence(rng, vocab, rng.randint(user_chars // 2, user_chars * 3 // 2))}\n" \
                  f"assistant: "
        requests.append(request)
        history[c] = request + sentence(rng, vocab, rng.randint(assistant_chars // 2, assistant_chars * 3 // 2)) + "\n"
        remaining[c] -= 1
        if remaining[c] == 0:
            active[i] = active[-1]
            active.pop()
    return requests


def run_policy(key: str, requests: list[str], workers: int, in_flight: int, seed: int) -> tuple[object, dict]:
    """One pass of the workload through a fresh policy; every ``select`` is timed alone."""
    policy = ROUTING.build(key, ROUTING.get(key).Config(), seed=seed)
    for i in range(workers):
        policy.add_worker(f"http://worker-{i}:30000")
    pending: collections.deque[str] = collections.deque()
    times_ns, picks = [], []
    reasons: collections.Counter[str] = collections.Counter()
    matched = total = 0
    clock = time.perf_counter_ns
    cpu0 = time.process_time()
    for text in requests:
        t0 = clock()
        worker = policy.select(text)
        times_ns.append(clock() - t0)
        d = policy.last_decision
        reasons[d.reason] += 1
        matched += d.matched_chars
        total += d.request_chars
        picks.append(worker)
        pending.append(worker)
        if len(pending) > in_flight:
            policy.on_request_done(pending.popleft())
    cpu_seconds = time.process_time() - cpu0  # CPU time: not inflated by other processes taking the cores
    return policy, summary(times_ns, cpu_seconds, matched, total, reasons), picks


def build_policy(key: str, seed: int):
    """The policy as ``router=<key>`` runs it: conf/router's preset (sticky_prefix: precise_prefix with its switches)."""
    cfg = compose([f"router={key}"]).router
    return ROUTING.build(cfg.name, cfg, seed=seed)


def run_exact_view(key: str, requests: list[str], workers: int, in_flight: int, seed: int,
                   cache_tokens: int, count_opcodes: bool = False) -> tuple[object, dict, list[str]]:
    """One pass through a policy on the exact view, each worker a real RadixCache of ``cache_tokens`` slots whose KV
    events (the emitter) reach the policy as the worker's would: a request's blocks are stored when it ends, before
    the router hears of its end; the least recently used leaves are evicted past the cache's size (BlockRemoved)."""
    policy = build_policy(key, seed)
    names = [f"http://worker-{i}:30000" for i in range(workers)]
    caches = {}
    for w in names:
        policy.add_worker(w)
        caches[w] = RadixCache(lambda slots: None)
        caches[w].observer = CacheEventEmitter(getattr(policy.cfg, "block_size", 16), lambda e, w=w: policy.on_worker_event(w, e))
    pending: collections.deque = collections.deque()
    times_ns, picks = [], []
    reasons: collections.Counter[str] = collections.Counter()
    matched = total = 0
    clock = time.perf_counter_ns
    cpu, cpu_ns = 0.0, []
    release_ns = [None] * len(requests)  # each request's ``on_request_done``, timed alone (the policy's release work)
    opcodes, release_opcodes, tracer = [], [], opcode_tracer()
    for text in requests:
        if count_opcodes:  # a separate pass: tracing makes the timings meaningless
            tracer.count = 0
            sys.settrace(tracer)
            worker = policy.select(text)
            sys.settrace(None)
            opcodes.append(tracer.count)
        c0 = time.thread_time_ns()
        t0 = clock()
        if not count_opcodes:
            worker = policy.select(text)
        times_ns.append(clock() - t0)
        cpu_ns.append(time.thread_time_ns() - c0)
        cpu += cpu_ns[-1] / 1e9
        d = policy.last_decision
        reasons[d.reason] += 1
        matched += d.matched_chars
        total += d.request_chars
        picks.append(worker)
        pending.append((worker, d, text, len(times_ns) - 1))
        if len(pending) > in_flight:
            done, decision, done_text, index = pending.popleft()
            tokens = list(done_text.encode())
            cache = caches[done]
            cache.insert(tokens, torch.arange(len(tokens), dtype=torch.int32))  # its events reach the policy
            over = cache.total_size() - cache_tokens
            if over > 0:
                cache.evict(over)
            if count_opcodes:
                tracer.count = 0
                sys.settrace(tracer)
            t0 = clock()
            policy.on_request_done(done, decision)
            release_ns[index] = clock() - t0
            if count_opcodes:
                sys.settrace(None)
                release_opcodes.append(tracer.count)
            policy.maintain()
    if count_opcodes:
        return policy, {"decision_opcodes_p50": statistics.median(opcodes),
                        "decision_opcodes_mean": statistics.fmean(opcodes),
                        "release_opcodes_p50": statistics.median(release_opcodes or [0]),
                        "release_opcodes_mean": statistics.fmean(release_opcodes or [0])}, picks
    return policy, {**summary(times_ns, cpu, matched, total, reasons, cpu_ns), **release_summary(times_ns, release_ns)}, \
        picks


def release_summary(times_ns: list[int], release_ns: list[int | None]) -> dict:
    """The release's p50 (``on_request_done``: the policy's bookkeeping at a request's end, which the HTTP router's
    decision timer does not cover) and the p50 of select + release per request, over the requests released."""
    released = [(t, r) for t, r in zip(times_ns, release_ns) if r is not None]
    if not released:
        return {}
    return {"release_median_us": statistics.median(r for _, r in released) / 1000,
            "release_mean_us": statistics.fmean(r for _, r in released) / 1000,
            "select_plus_release_median_us": statistics.median(t + r for t, r in released) / 1000}


def release_table(rows: dict, keys: list[str]) -> dict:
    """Each exact-view policy's release p50 and select + release p50 beside cache_aware_fed's: the whole of what a
    policy does on a request's path (the HTTP router times the select only, for every policy alike)."""
    if not keys or "release_median_us" not in rows[FED]:  # nothing released (fewer requests than kept in flight)
        return {}
    fed, out = rows[FED], {}
    print(f"\n{'policy':<15} {'release p50 us':>15} {'select+release p50 us':>22} {'x cache_aware_fed':>18}")
    for key in (FED, *keys):
        r = rows[key]
        ratio = r["select_plus_release_median_us"] / fed["select_plus_release_median_us"]
        out[f"{key}_select_plus_release_over_{FED}_p50_ratio"] = ratio
        print(f"{key:<15} {r['release_median_us']:>15.2f} {r['select_plus_release_median_us']:>22.2f} {ratio:>18.2f}")
    return out


def opcode_tracer():
    """A ``sys.settrace`` function counting the Python opcodes run under it (``.count``; ``.by_function``: per
    ``file:function``, over every traced call): the interpreter's work per decision, the same on a quiet and a loaded
    machine (what it does not count: work inside C calls)."""
    by_function = collections.Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            trace.count += 1
            code = frame.f_code
            by_function[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        return trace
    trace.count, trace.by_function = 0, by_function
    return trace


def run_plain(requests: list[str], workers: int, in_flight: int, seed: int) -> tuple[dict, list[str]]:
    """The same pass through the plain tree (the yardstick)."""
    tree = PlainCacheAware([f"http://worker-{i}:30000" for i in range(workers)], seed=seed)
    pending: collections.deque[str] = collections.deque()
    times_ns, picks = [], []
    matched = total = 0
    clock = time.perf_counter_ns
    cpu0 = time.process_time()
    for text in requests:
        t0 = clock()
        worker, held = tree.select(text)
        times_ns.append(clock() - t0)
        matched += held
        total += len(text)
        picks.append(worker)
        pending.append(worker)
        if len(pending) > in_flight:
            tree.done(pending.popleft())
    cpu_seconds = time.process_time() - cpu0
    return summary(times_ns, cpu_seconds, matched, total, collections.Counter()), picks


def summary(times_ns: list[int], cpu_seconds: float, matched: int, total: int, reasons,
            cpu_ns: list[int] | None = None) -> dict:
    """``cpu_ns``: each decision's own CPU time (the thread's), which a core taken by another process does not
    inflate: a wall-clock p99 on a shared machine is mostly decisions that waited for a core."""
    us = sorted(t / 1000 for t in times_ns)
    cpu_us = sorted(t / 1000 for t in cpu_ns) if cpu_ns else []
    return {
        **({"decision_cpu_median_us": statistics.median(cpu_us),
            "decision_cpu_p99_us": cpu_us[int(0.99 * (len(cpu_us) - 1))]} if cpu_us else {}),
        "decision_median_us": statistics.median(us),
        "decision_p99_us": us[int(0.99 * (len(us) - 1))],
        "decision_mean_us": statistics.fmean(us),
        "loop_cpu_us_per_request": cpu_seconds / len(us) * 1e6,
        "estimated_hit_rate": matched / total,
        **{f"decisions_{r}": n for r, n in sorted(reasons.items())},
    }


def eviction_pass(policy) -> dict:
    """Evict the run's tree down to half the mean per-worker size, then time a pass with nothing to evict."""
    tree = policy.tree
    sizes = [tree.tenant_size(w) for w in policy.workers]
    bound = int(statistics.fmean(sizes) / 2)
    before_chars, before_nodes = tree.total_chars, tree.node_count
    t0 = time.perf_counter()
    evicted = tree.evict(bound)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    tree.evict(bound)
    idle_seconds = time.perf_counter() - t0
    return {
        "tree_chars_before_eviction": before_chars,
        "tree_nodes_before_eviction": before_nodes,
        "tenant_chars_before_eviction": sum(sizes),
        "eviction_bound_chars_per_worker": bound,
        "tenant_chars_evicted": evicted,
        "tree_chars_after_eviction": tree.total_chars,
        "eviction_pass_ms": seconds * 1e3,
        "eviction_idle_pass_ms": idle_seconds * 1e3,
    }


def best_of(runs: list[dict], key: str) -> dict:
    """The run least disturbed by other processes (lowest ``key``), as timeit reports; ``key`` of every run kept."""
    best = dict(min(runs, key=lambda r: r[key]))
    best[f"{key}_all_runs"] = [r[key] for r in runs]
    return best


POLICIES = ("plain_tree", "cache_aware", "round_robin", "random")
EXACT_VIEW = ("precise_prefix", "sticky_prefix", "kv_cost")  # fed KV events by real caches (run_exact_view)
FED = "cache_aware_fed"  # cache_aware in the exact-view policies' loop: the like-for-like yardstick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="fresh runs per policy; the least disturbed is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-tokens", type=int, default=200_000,
                    help="each worker's cache for the exact-view policies (evicted LRU past it)")
    ap.add_argument("--exact-view", nargs="*", default=list(EXACT_VIEW), help="exact-view policies to time")
    ap.add_argument("--opcodes", type=int, default=2000,
                    help="count the Python opcodes of this many decisions per exact-view policy (0: skip)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    requests = multi_turn_workload(args.conversations, args.turns, args.seed)
    lengths = [len(r) for r in requests]
    print(f"workload: {len(requests)} requests, mean {statistics.fmean(lengths):.0f} chars, "
          f"max {max(lengths)}, {args.workers} workers, {args.in_flight} in flight, best of {args.repeats} runs "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")

    fed = [FED] if args.exact_view else []
    runs: dict[str, list[dict]] = {key: [] for key in (*POLICIES, *fed, *args.exact_view)}
    evictions, tree, same = [], {}, True
    for _ in range(args.repeats):  # one run of each policy per repeat: plain tree and cache_aware side by side
        row, plain_picks = run_plain(requests, args.workers, args.in_flight, args.seed)
        runs["plain_tree"].append(row)
        for key in POLICIES[1:]:
            policy, row, picks = run_policy(key, requests, args.workers, args.in_flight, args.seed)
            runs[key].append(row)
            if key == "cache_aware":
                same = same and picks == plain_picks
                tree = {"tree_chars": policy.tree.total_chars, "tree_nodes": policy.tree.node_count}
                evictions.append(eviction_pass(policy))
            del policy
            gc.collect()
        for key in (*fed, *args.exact_view):
            _, row, _ = run_exact_view("cache_aware" if key == FED else key, requests, args.workers, args.in_flight,
                                       args.seed, args.cache_tokens)
            runs[key].append(row)
            gc.collect()
    if not same:
        raise SystemExit("the plain tree and cache_aware chose different workers: the yardstick is not comparable")
    rows = {key: best_of(r, "decision_median_us") for key, r in runs.items()}
    ratios = sorted(c["decision_median_us"] / p["decision_median_us"]
                    for c, p in zip(runs["cache_aware"], runs["plain_tree"]))
    evict = best_of(evictions, "eviction_pass_ms")

    print(f"\n{'policy':<12} {'median us':>10} {'medians over repeats':>21} {'p99 us':>8} {'mean us':>8} "
          f"{'cpu us':>7} {'est. hit':>9}  decisions by reason")
    for key, r in rows.items():
        by_reason = ", ".join(f"{k[len('decisions_'):]}={v}" for k, v in r.items() if k.startswith("decisions_"))
        medians = r["decision_median_us_all_runs"]
        print(f"{key:<12} {r['decision_median_us']:>10.2f} {min(medians):>10.2f} - {max(medians):>8.2f} "
              f"{r['decision_p99_us']:>8.2f} {r['decision_mean_us']:>8.2f} {r['loop_cpu_us_per_request']:>7.2f} "
              f"{r['estimated_hit_rate']:>9.3f}  {by_reason}")
    rr_ratio = rows["cache_aware"]["decision_median_us"] / rows["round_robin"]["decision_median_us"]
    print(f"\ncache_aware x plain tree (same decisions: {'yes' if same else 'no'}), median over the repeats: "
          f"{statistics.median(ratios):.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    print(f"cache_aware tree: {tree['tree_chars']:,} chars in {tree['tree_nodes']:,} nodes; eviction pass down to "
          f"{evict['eviction_bound_chars_per_worker']:,} chars/worker: {evict['eviction_pass_ms']:.2f} ms "
          f"({evict['tenant_chars_evicted']:,} worker-chars evicted, tree now {evict['tree_chars_after_eviction']:,} "
          f"chars); pass with nothing to evict: {evict['eviction_idle_pass_ms']:.3f} ms")
    print(f"cache_aware median decision = {rr_ratio:.1f}x round_robin's")
    versus = exact_view_table(rows, runs, args.exact_view)
    versus.update(release_table(rows, args.exact_view))
    versus.update(opcode_table(requests[:args.opcodes], args) if args.opcodes and args.exact_view else {})

    results = {
        "requests": len(requests), "conversations": args.conversations, "turns": args.turns,
        "workers": args.workers, "in_flight": args.in_flight, "repeats": args.repeats, "seed": args.seed,
        "request_chars_mean": statistics.fmean(lengths),
        **{f"{key}_{k}": v for key, r in rows.items() for k, v in r.items()},
        **{f"cache_aware_{k}": v for k, v in {**tree, **evict}.items()},
        "cache_aware_over_round_robin_median_ratio": rr_ratio,
        "cache_aware_over_plain_tree_median_ratio": statistics.median(ratios),
        "cache_aware_over_plain_tree_ratio_all_runs": ratios,
        "cache_aware_same_decisions_as_plain_tree": same,
        "exact_view_cache_tokens": args.cache_tokens,
        **versus,
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def exact_view_table(rows: dict, runs: dict, keys: list[str]) -> dict:
    """Each exact-view policy's p50 / p99 beside cache_aware's (its own loop, and ``cache_aware_fed``: the same loop as
    theirs), with the ratios (issue 25: within 2x); the p50 ratios are also taken repeat by repeat and their median
    kept (the same moment of a noisy machine)."""
    if not keys:
        return {}
    print(f"\n{'policy':<15} {'p50 us':>8} {'p99 us':>8} {'est. hit':>9} | vs cache_aware: {'p50 x':>6} "
          f"{'(per rep)':>9} {'p99 x':>6} | vs cache_aware_fed: {'p50 x':>6} {'(per rep)':>9} {'p99 x':>6} "
          f"| CPU p50 / p99 us")
    for key in ("cache_aware", FED):
        r = rows[key]
        print(f"{key:<15} {r['decision_median_us']:>8.2f} {r['decision_p99_us']:>8.2f} {r['estimated_hit_rate']:>9.3f}"
              f"  {_cpu(r)}")
    out = {}
    for key in keys:
        r, cells = rows[key], []
        for base in ("cache_aware", FED):
            b = rows[base]
            per_repeat = statistics.median(a["decision_median_us"] / c["decision_median_us"]
                                           for a, c in zip(runs[key], runs[base]))
            ratios = {"p50_ratio": r["decision_median_us"] / b["decision_median_us"],
                      "p50_ratio_per_repeat": per_repeat, "p99_ratio": r["decision_p99_us"] / b["decision_p99_us"]}
            out.update({f"{key}_over_{base}_{k}": v for k, v in ratios.items()})
            cells.append(f"{ratios['p50_ratio']:>6.2f} {per_repeat:>9.2f} {ratios['p99_ratio']:>6.2f}")
        print(f"{key:<15} {r['decision_median_us']:>8.2f} {r['decision_p99_us']:>8.2f} {r['estimated_hit_rate']:>9.3f} "
              f"| {'':>15} {cells[0]} | {'':>19} {cells[1]} {_cpu(r)}")
    return out


def opcode_table(requests: list[str], args) -> dict:
    """Python opcodes per decision (p50, mean) of each exact-view policy and of cache_aware in their loop, over the
    first ``--opcodes`` requests: the interpreter's share of a decision, which a loaded machine does not blur."""
    out = {}
    print(f"\nPython opcodes per decision (first {len(requests)} requests): policy, p50, mean, p50 x cache_aware's; "
          f"and per release (on_request_done) p50, mean")
    for key in (FED, *args.exact_view):
        _, row, _ = run_exact_view("cache_aware" if key == FED else key, requests, args.workers, args.in_flight,
                                   args.seed, args.cache_tokens, count_opcodes=True)
        out.update({f"{key}_{k}": v for k, v in row.items()})
        base = out[f"{FED}_decision_opcodes_p50"]
        print(f"{key:<15} {row['decision_opcodes_p50']:>7.0f} {row['decision_opcodes_mean']:>8.1f} "
              f"{row['decision_opcodes_p50'] / base:>6.2f} | {row['release_opcodes_p50']:>6.0f} "
              f"{row['release_opcodes_mean']:>7.1f}")
    return out


def _cpu(r: dict) -> str:
    return f"| {r['decision_cpu_median_us']:.1f} / {r['decision_cpu_p99_us']:.1f}" if "decision_cpu_p99_us" in r else ""


if __name__ == "__main__":
    main()
