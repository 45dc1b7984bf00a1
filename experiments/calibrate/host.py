"""Host time per step of servelab's SGLang-faithful scheduler on this machine (issue 19, item 4): the CPU seconds of
one scheduler round (`next_batch` + `process`, as SGLang's event_loop_normal runs get_next_batch_to_run and
process_batch_result) against the requests it holds, on the simulator's counting KV pool (no forward pass).

- decode: N requests decoding (no EOS, long answers): the median CPU time of a decode round, per N;
- extend: M new requests of L prompt tokens admitted in one EXTEND round: the median CPU time of that round, per M.

A least-squares line through each gives the host terms `sim.cost.host_step_us` (intercept), `host_running_us`
(per running request of a DECODE batch) and `host_new_req_us` (per request of an EXTEND batch). They are this
machine's; `sim.cost.host_speed_factor` carries them to a 2024 H100 host (docs/fidelity.md says which public
single-thread figures give it). Medians of --repeats (the machine is shared and noisy).

    python experiments/calibrate/host.py            # ~1 minute; writes experiments/calibrate/results.json
    python experiments/calibrate/host.py --quick --out /tmp/h.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.core.paths import git_sha  # noqa: E402
from framework.engine.config import EngineConfig  # noqa: E402
from framework.engine.kv_pool import CountingKVPool  # noqa: E402
from framework.engine.request import Req, SamplingParams  # noqa: E402
from framework.engine.scheduler import Scheduler  # noqa: E402

EOS = 10 ** 6            # never sampled: requests run to max_new_tokens


def scheduler(capacity: int) -> Scheduler:
    cfg = EngineConfig(max_running_requests=None, radix_cache=False, chunked_prefill_tokens=8192)
    return Scheduler(cfg, CountingKVPool(capacity), EOS, lambda ids: "", context_len=capacity)


def decode_round_s(n: int, repeats: int) -> float:
    """Median CPU seconds of a DECODE round with n requests running."""
    s = scheduler(capacity=n * 600 + 10_000)
    for i in range(n):
        s.add(Req([1 + i % 200] * 4, SamplingParams(max_new_tokens=400, ignore_eos=True), rid=f"d{i}"))
    while True:                                   # admit everyone (EXTEND rounds), then decode
        b = s.next_batch()
        s.process(b, [7] * sum(b.sample), 0.0)
        if b.mode.is_decode() and len(b.reqs) == n:
            break
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        b = s.next_batch()
        s.process(b, [7] * len(b.reqs), 0.0)
        times.append(time.thread_time() - t)
    return statistics.median(times)


def extend_round_s(m: int, prompt: int, repeats: int) -> float:
    """Median CPU seconds of an EXTEND round admitting m new requests of `prompt` tokens."""
    times = []
    for r in range(repeats):
        s = scheduler(capacity=m * (prompt + 64) + 10_000)
        for i in range(m):
            s.add(Req([1 + (i + r) % 200] * prompt, SamplingParams(max_new_tokens=8, ignore_eos=True),
                      rid=f"e{r}-{i}"))
        t = time.thread_time()
        b = s.next_batch()
        s.process(b, [7] * sum(b.sample), 0.0)
        times.append(time.thread_time() - t)
        if len(b.reqs) != m:
            raise RuntimeError(f"the EXTEND round took {len(b.reqs)} of {m} requests")
    return statistics.median(times)


def stream_chunk_s(n: int, repeats: int) -> float:
    """Median CPU seconds per streamed chunk of the front end's work for one step's n outputs, as SGLang v0.4 moves
    them: the scheduler pickles the step's lists to the detokenizer (zmq), which decodes each request's new token
    and pickles the texts on to the TokenizerManager, which builds each request's output dict and writes one
    server-sent event per request (json). Measured with pickle and json in one thread (no sockets)."""
    import pickle
    rids = [f"{i:032x}" for i in range(n)]
    times = []
    for r in range(repeats):
        t = time.thread_time()
        batch = pickle.loads(pickle.dumps((rids, [[7]] * n, [None] * n, [1] * n, [r] * n)))
        texts = pickle.loads(pickle.dumps([bytes([65 + i % 26]).decode() for i in range(n)]))
        for rid, text in zip(batch[0], texts):
            out = {"text": text, "meta_info": {"id": rid, "finish_reason": None, "prompt_tokens": 512,
                                               "completion_tokens": r + 1, "cached_tokens": 0}}
            (b"data: " + json.dumps(out).encode() + b"\n\n")
        times.append((time.thread_time() - t) / n)
    return statistics.median(times)


def line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results.json")
    args = ap.parse_args()
    running = (1, 8, 32) if args.quick else (1, 16, 64, 256, 512, 1024)
    new = (1, 4) if args.quick else (1, 4, 8, 15)
    repeats = 3 if args.quick else args.repeats
    decode = {n: decode_round_s(n, repeats) for n in running}
    extend = {m: extend_round_s(m, 512, repeats) for m in new}
    chunk = stream_chunk_s(256, repeats)
    a_d, b_d = line(list(decode), list(decode.values()))
    a_e, b_e = line(list(extend), list(extend.values()))
    out = {"experiment": "calibrate/host", "git_sha": git_sha(), "quick": args.quick, "repeats": repeats,
           "cpu": _cpu_model(), "load_avg": os.getloadavg(), "clock": "time.thread_time (CPU seconds)",
           "decode_round_s": decode, "extend_round_s_prompt512": extend,
           "fit": {"host_step_us": round(1e6 * (a_d + a_e) / 2, 2), "host_running_us": round(1e6 * b_d, 3),
                   "host_new_req_us": round(1e6 * b_e, 3),
                   "stream_us_per_chunk": round(1e6 * chunk, 3),
                   "decode_intercept_us": round(1e6 * a_d, 2), "extend_intercept_us": round(1e6 * a_e, 2)}}
    print("| running | decode round us |\n|---:|---:|")
    for n, t in decode.items():
        print(f"| {n} | {t * 1e6:,.1f} |")
    print("\n| new requests (512 tokens) | extend round us |\n|---:|---:|")
    for m, t in extend.items():
        print(f"| {m} | {t * 1e6:,.1f} |")
    print(f"\nfit: {out['fit']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"results: {args.out}")


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
