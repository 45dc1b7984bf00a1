"""Issue 19, item 7: the pre-registered prediction. Runs mode=sim with the parameters frozen in conf/sim/cost/ and
plugins/cost/ (every one from a source other than the predicted figures: docs/fidelity.md, "Cost model terms") for

- SGLang PR #1970's four cells (conf/experiment/pr1970.yaml: DeepSeek-Coder-V2-Instruct-FP8 on 8 x H100, 10,000
  random prompts at once): decode (input 1, output 512) and prefill (input 512, output 1), TP 8 and DP attention 8;
  the figure as bench_serving prints it: output tok/s for decode, input tok/s for prefill (its input count is the
  dataset's lengths: the server's BOS is not in it);
- SGLang PR #2170's two figures (conf/experiment/sglang_router_blog.yaml: 8 x A100 workers, generated-shared-prefix):
  total (input + output) tok/s under round robin and cache-aware routing, with the Llama-3.1-8B stand-in.

Writes predictions_round<N>.json (the figures, the cost model's config, the git commit and a digest of the model's
files; no published figure) and predictions_round<N>.md. compare.py holds the published figures.

    python experiments/sim_repro/predict.py --round 1      # ~2 minutes
    python experiments/sim_repro/predict.py --round 2      # PR #1970 as its code stood then (SETUPS below)
    python experiments/sim_repro/predict.py --round 3      # round 2 + its MoE kernel's published rates
    python experiments/sim_repro/predict.py --round 4      # round 3 + 2024 SGLang's own host work, measured
    python experiments/sim_repro/predict.py --round 5      # round 4, measured at PR #1970's 10,000 open streams
    python experiments/sim_repro/predict.py --round 6      # round 5, a request's host work per request and per token
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.core.paths import git_sha  # noqa: E402
from framework.runs.sim import simulate  # noqa: E402

SCHEMES = {"tp": ["parallel=tp", "engine.chunked_prefill_tokens=8192"],
           "dp_attn": ["parallel=dp_attn", "engine.chunked_prefill_tokens=4096"]}   # SGLang halves it under DP
# PR #1970's setup per round: the experiment, and what each scheme adds. Round 1: SGLang v0.4.1's inputs. Round 2: the
# code as of PR #1970's figures (conf/experiment/pr1970_nov2024.yaml: the decode kernel before PR #2394); under DP
# attention no CUDA graphs yet (PR #2061, merged 2024-11-17) and schedule_conservativeness 1.0 (PR #2096, 2024-11-20).
# Round 3: round 2's, and the routed experts at most at the published rate of the fused MoE kernel they ran, vLLM's at
# its 2024 default config on an H100 (plugins/cost/lib/fused_moe_triton.py). "all": what every scheme adds
# Round 4: round 3's, and the host work of 2024 SGLang's own code (experiments/sglang035_host: sglang 0.3.5's
# scheduler, TokenizerManager, DetokenizerManager and bench_serving measured on this CPU with the GPU taken out;
# data/calibration/sglang035_host_*.json), for every cell: PR #2170's v0.4 workers stream the same way.
DP_NOV2024 = ["engine.cuda_graph=false", "parallel.schedule_conservativeness=1.0"]
CALIBRATION = ROOT / "data" / "calibration"


def host_2024(decode_run: str = "sglang035_host_decode.json",
              prefill_runs: tuple[str, ...] = ("sglang035_host_prefill.json",)) -> list[str]:
    """The cost model's host and front-end terms from sglang 0.3.5's measured host work: the scheduler's per decode
    step (its fixed part, per running request, per output token so far) from the decode run; the front end at its
    slowest process's price per streamed chunk (the TokenizerManager with HTTP, below ~590 output tokens at 2,500
    streams); from the prefill runs, an extend's scheduler work and a request's own front-end work (HTTP, tokenizing).
    One prefill run (rounds 4, 5) prices the latter two per request and per prompt token alone; two runs of other
    prompt lengths (round 6) split each into a per-request and a per-token part."""
    dec = json.loads((CALIBRATION / decode_run).read_text())
    sched, tm = dec["scheduler_decode"], dec["chunk_fits"]["tokenizer_manager_http"]
    decode = [f"sim.cost.host_step_us={sched['step_us']:.1f}",
              f"sim.cost.host_running_us={sched['per_running_request_us']:.3f}",
              f"sim.cost.host_output_token_us={sched['per_output_token_us']:.4f}"]
    chunks = [f"sim.cost.stream_us_per_chunk={tm['per_chunk_us']:.1f}",
              f"sim.cost.stream_us_per_output_token={tm['per_output_token_us']:.4f}"]
    runs = []
    for name in prefill_runs:
        pre = json.loads((CALIBRATION / name).read_text())
        ext = pre["scheduler_extend"]
        runs.append({"prompt": pre["input_tokens"] / pre["settings"]["num_prompts"],
                     # the TokenizerManager's work a request (HTTP in and out, tokenizing, its one chunk) less the chunk
                     "front": pre["cpu_us_per_request"]["tokenizer_manager_http"] - tm["per_chunk_us"],
                     # an extend's CPU less the step's fixed part, which host_step_us prices
                     "extend": ext["cpu_per_step_ms_median"] * 1e3 - sched["step_us"],
                     "requests": ext["requests_median"], "tokens": ext["new_tokens_median"],
                     # rounds 4-5: the median of the extends' CPU a request, less its share of the fixed part
                     "per_request": ext["per_new_request_us"] - sched["step_us"] / ext["requests_median"]})
    if len(runs) == 1:
        r = runs[0]
        return decode + [f"sim.cost.host_new_req_us={r['per_request']:.1f}"] + chunks \
            + [f"sim.cost.tokenize_us_per_token={r['front'] / r['prompt']:.3f}"]
    if len(runs) != 2:
        raise SystemExit(f"host_2024 takes one or two prefill runs, got {len(runs)}")
    a, b = runs
    det = a["requests"] * b["tokens"] - b["requests"] * a["tokens"]
    per_req = (a["extend"] * b["tokens"] - b["extend"] * a["tokens"]) / det
    per_tok = (a["requests"] * b["extend"] - b["requests"] * a["extend"]) / det
    tok = (a["front"] - b["front"]) / (a["prompt"] - b["prompt"])
    req = a["front"] - tok * a["prompt"]
    if min(per_req, per_tok, tok, req) < 0:
        raise SystemExit(f"the prefill runs {prefill_runs} split into a negative part (extend: {per_req:.1f} us a "
                         f"request, {per_tok:.3f} a token; front end: {req:.1f} a request, {tok:.3f} a token)")
    return decode + [f"sim.cost.host_new_req_us={per_req:.1f}", f"sim.cost.host_new_token_us={per_tok:.4f}"] + chunks \
        + [f"sim.cost.tokenize_us_per_request={req:.1f}", f"sim.cost.tokenize_us_per_token={tok:.3f}"]


SETUPS = {1: ("pr1970", {}),
          2: ("pr1970_nov2024", {"dp_attn": DP_NOV2024}),
          3: ("pr1970_nov2024", {"all": ["sim.cost.fused_moe_rates=true"], "dp_attn": DP_NOV2024}),
          4: ("pr1970_nov2024", {"all": ["sim.cost.fused_moe_rates=true", "<host_2024>"], "dp_attn": DP_NOV2024}),
          5: ("pr1970_nov2024", {"all": ["sim.cost.fused_moe_rates=true", "<host_2024_10k>"], "dp_attn": DP_NOV2024}),
          6: ("pr1970_nov2024", {"all": ["sim.cost.fused_moe_rates=true", "<host_2024_split>"], "dp_attn": DP_NOV2024})}
# what PR #2170's cells add (none before round 4)
ROUTER_SETUPS = {4: ["<host_2024>"], 5: ["<host_2024_10k>"], 6: ["<host_2024_split>"]}
# Round 5: round 4's, with the decode run's fits measured at PR #1970's own 10,000 prompts (10,000 open streams;
# round 4's run held 2,500): data/calibration/sglang035_host_decode_10k.json. Round 6: round 5's, with a request's
# extend and front-end work split into a per-request and a per-token part by a second prefill run of 128-token
# prompts (data/calibration/sglang035_host_prefill_128.json)
HOSTS = {"<host_2024>": lambda: host_2024(), "<host_2024_10k>": lambda: host_2024("sglang035_host_decode_10k.json"),
         "<host_2024_split>": lambda: host_2024("sglang035_host_decode_10k.json",
                                                ("sglang035_host_prefill.json", "sglang035_host_prefill_128.json"))}


# the cost-model keys host_2024 sets (any round)
HOST_KEYS = ("host_step_us", "host_running_us", "host_output_token_us", "host_new_req_us", "host_new_token_us",
             "stream_us_per_chunk", "stream_us_per_output_token", "tokenize_us_per_request", "tokenize_us_per_token")


def expand(overrides: list[str]) -> list[str]:
    """The overrides with each host placeholder (HOSTS' keys) replaced by the terms it stands for."""
    return [o for item in overrides for o in (HOSTS[item]() if item in HOSTS else [item])]


BENCHES = {"decode": ["workload.input_len=1", "workload.output_len=512"],
           "prefill": ["workload.input_len=512", "workload.output_len=1"]}
ROUTERS = ("round_robin", "cache_aware")
MODEL_FILES = ("plugins/cost/roofline.py", "plugins/cost/_host.py", "plugins/cost/_layout.py",
               "plugins/cost/lib/fused_moe_triton.py", "plugins/cost/lib/expert_load.py",
               "framework/contracts/cost.py", "framework/gpu/roofline.py", "framework/gpu/hardware.py",
               "framework/sim/cluster.py", "framework/sim/instance.py", "framework/sim/frontend.py",
               "framework/engine/cuda_graph.py", "conf/experiment/pr1970.yaml",
               "conf/experiment/sglang_router_blog.yaml",
               "conf/experiment/pr1970_nov2024.yaml", "plugins/parallelism/dp_attn.py",
               "conf/hardware/h100_sxm.yaml", "conf/hardware/a100_80g.yaml", "data/gpu-profiles/fit/h100.json",
               "data/gpu-profiles/fit/a100.json", "data/calibration/sglang035_host_decode.json",
               "data/calibration/sglang035_host_prefill.json", "data/calibration/sglang035_host_decode_10k.json",
               "data/calibration/sglang035_host_prefill_128.json")
KEYS = ("output_throughput_tok_s", "input_throughput_tok_s", "total_throughput_tok_s", "duration_s",
        "requests_completed", "requests_failed", "max_running_requests", "kv_capacity_tokens_instance",
        "cache_hit_rate", "sim_cost_config", "sim_wall_s")


def run(overrides: list[str]) -> dict:
    results, _ = simulate(compose(overrides))
    return {k: results.get(k) for k in KEYS}


def pr1970(bench: str, scheme: str, extra: list[str], rnd: int = 1) -> dict:
    if rnd not in SETUPS:
        raise SystemExit(f"--round {rnd} has no PR #1970 setup; rounds: {', '.join(map(str, SETUPS))} (SETUPS)")
    experiment, per_scheme = SETUPS[rnd]
    overrides = expand([f"experiment={experiment}"] + SCHEMES[scheme] + per_scheme.get("all", [])
                       + per_scheme.get(scheme, []) + BENCHES[bench] + extra)
    cfg = compose(overrides)
    r = run(overrides)
    w = cfg.workload
    if bench == "decode":                          # bench_serving: output tokens over the benchmark's duration
        figure, unit = r["output_throughput_tok_s"], "output tok/s"
    else:                                          # its input count: the dataset's lengths (no BOS)
        figure, unit = w.num_prompts * w.input_len / r["duration_s"], "input tok/s"
    return {"cell": f"pr1970/{bench}/{scheme}", "figure": figure, "unit": unit, "overrides": overrides, "sim": r}


def router_blog(router: str, extra: list[str], rnd: int = 1) -> dict:
    overrides = expand(["experiment=sglang_router_blog", "model=llama31_8b_mla", f"router={router}"]
                       + ROUTER_SETUPS.get(rnd, []) + extra)
    r = run(overrides)
    return {"cell": f"pr2170/{router}", "figure": r["total_throughput_tok_s"], "unit": "total tok/s",
            "overrides": overrides, "sim": r}


def digest() -> dict:
    return {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest()[:16] for p in MODEL_FILES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the overlap-on variants of the TP cells")
    args = ap.parse_args()
    t0 = time.time()
    cells = [pr1970(b, s, [], args.round) for b in BENCHES for s in SCHEMES] \
        + [router_blog(r, [], args.round) for r in ROUTERS]
    for c in cells:
        print(f"  {c['cell']:<24} {c['figure']:10,.0f} {c['unit']}  ({c['sim']['sim_wall_s']:.0f} s)", flush=True)
    by = {c["cell"]: c["figure"] for c in cells}
    ratios = {"pr1970/decode dp_attn / tp": by["pr1970/decode/dp_attn"] / by["pr1970/decode/tp"],
              "pr1970/prefill dp_attn / tp": by["pr1970/prefill/dp_attn"] / by["pr1970/prefill/tp"],
              "pr2170/cache_aware / round_robin": by["pr2170/cache_aware"] / by["pr2170/round_robin"]}
    sensitivity = []
    if not args.no_sensitivity:     # not the prediction: how much the one unverified default moves the TP cells
        sensitivity = [pr1970(b, "tp", ["sim.cost.overlap_schedule=on"], args.round) for b in BENCHES]
        for c in sensitivity:
            print(f"  (sensitivity, overlap on) {c['cell']:<22} {c['figure']:10,.0f} {c['unit']}", flush=True)
    out = {"experiment": "sim_repro/predict", "round": args.round, "git_sha": git_sha(), "model_digest": digest(),
           "predictions": {c["cell"]: {"figure": c["figure"], "unit": c["unit"]} for c in cells},
           "ratios": ratios, "cells": cells,
           "sensitivity_not_the_prediction": {c["cell"] + "/overlap_on": c["figure"] for c in sensitivity},
           "wall_s": time.time() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"predictions_round{args.round}.json"
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    lines = [f"# Predictions, round {args.round} (pre-registered: no published figure here; compare.py has them)", "",
             f"git {out['git_sha']}; cost model config and file digests in {path.name}.", "",
             f"PR #1970's setup: experiment={SETUPS[args.round][0]}"
             + "".join(f"; {k} cells add {' '.join(expand(v))}" for k, v in SETUPS[args.round][1].items())
             + (f"; PR #2170's cells add {' '.join(expand(ROUTER_SETUPS[args.round]))}"
                if args.round in ROUTER_SETUPS else "") + ".", "",
             "| cell | predicted | unit |", "|---|---:|---|"]
    lines += [f"| {c['cell']} | {c['figure']:,.0f} | {c['unit']} |" for c in cells]
    lines += ["", "| ratio | predicted |", "|---|---:|"] + [f"| {k} | {v:.2f}x |" for k, v in ratios.items()]
    if sensitivity:
        lines += ["", "Sensitivity (not the prediction): the TP cells with SGLang's overlap scheduler on "
                  "(`sim.cost.overlap_schedule=on`; the prediction uses v0.4's choice, off on the Triton backend).", "",
                  "| cell | overlap on |", "|---|---:|"]
        lines += [f"| {c['cell']} | {c['figure']:,.0f} |" for c in sensitivity]
    (args.out / f"predictions_round{args.round}.md").write_text("\n".join(lines) + "\n")
    print(f"predictions: {path} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
