"""Predict DistServe's OPT-13B chatbot result (OSDI'24, section 6.2, Figure 8 top row) in mode=sim, before reading it:
the SLO attainment of a colocated vLLM instance (1 GPU) and of DistServe's disaggregated pair (a prefill instance on
2 GPUs with TP, a decode instance on 1 GPU, one node: the KV over NVLink) against the per-GPU request rate, and the
per-GPU goodput (the highest per-GPU Poisson rate at which >= 90% of requests meet both SLOs) of each, and their
ratio. Writes predictions.json beside this file; the published figures are in compare.py, which reads it.

The setup is DistServe's artifact's (LLMServe/DistServe, evaluation/2-benchmark-serving/2-start-api-server.py and
evaluation/ae-scripts/e2e/opt-13b-distllm-client.sh), each figure's source in SETUP below; what servelab cannot
express is said there too (the model is an MLA stand-in, the engines are servelab's SGLang-v0.4 scheduler).

    python experiments/pd_repro/predict.py [--round 1|2|3|4] [--sharegpt PATH] [--requests 300] [--quick]

--round 1 (predictions.json, committed in 7b49e78): DistServe on servelab's decode admission (SGLang's 512 future
tokens kept per decoding request) and ShareGPT's first exchange as the prompt. --round 2 (predictions_round2.json):
DistServe's and vLLM 0.2's own policies and DistServe's dataset preparation, each from the artifact's or vLLM's code,
none from the figure (ROUND2 below). --round 3 (predictions_round3.json): round 2 with the vLLM baseline run by vLLM's
own scheduler, as DistServe's artifact built it (engine.scheduler=vllm_v0_1_7; ROUND3 below); DistServe's side as in
round 2. From round 3 the file holds no wall-clock figure, so a rerun writes it byte for byte. --round 4
(predictions_round4.json): round 3 with every step priced by DistServe's own profile of each engine
(sim.cost=distserve_profile; ROUND4 below); the workload as round 2 (no independent length statistic found). It also
runs round 3's cost model on the same grid and prints the change per side (the sensitivity).

--sharegpt: the real ShareGPT file (ShareGPT_V3_unfiltered_cleaned_split.json, which DistServe samples); without it,
the synthetic ShareGPT-format sample this repository ships (data/sharegpt/, log-normal lengths, not real chats), and
predictions.json says so.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import tempfile
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.config import compose  # noqa: E402
from framework.core.registry import ROUTING, WORKLOAD  # noqa: E402
from framework.engine.config import Role  # noqa: E402
from framework.report.metrics import summarize  # noqa: E402
from framework.runs.sim import cost_model  # noqa: E402
from framework.serving.router.config import split_router_config  # noqa: E402
from framework.sim.cluster import Simulation  # noqa: E402
from framework.sim.instance import SimInstance  # noqa: E402
from framework.sim.pd import PD, instance_config  # noqa: E402
from framework.sim.router import SimRouter  # noqa: E402

MEM_MB = 0.95 * 80 * 1024  # --gpu-memory-utilization 0.95 of an 80 GB A100 (2-start-api-server.py, both systems)
ATTAINMENT = 0.9          # DistServe's goodput: the highest rate with >= 90% of requests within both SLOs
SETUP = {
    "model": "OPT-13B, fp16 (DistServe section 6.1; model=opt13b_mla, an MLA stand-in with OPT's shapes and KV bytes)",
    "hardware": "A100-SXM4-80GB, NVLink inside a node (DistServe section 6.1; hardware=a100_80g)",
    "slo": "chatbot OPT-13B: TTFT 0.25 s, TPOT 0.1 s (DistServe Table 1)",
    "workload": "ShareGPT, Poisson arrivals, 300 requests per rate (opt-13b-distllm-client.sh: --num-prompts-req-rates "
                "[(300, r), ...]); without --sharegpt, all 190 usable conversations of the shipped synthetic sample",
    "vllm": "one instance, TP 1 (2-start-api-server.py: vllm 1), max-num-batched-tokens 16384, max-num-seqs 1024, no "
            "chunked prefill, no prefix caching (vLLM 0.2's scheduler, prefill first; here servelab's with a "
            "16384-token prefill chunk, FCFS, no radix cache)",
    "distserve": "prefill TP 2, decode TP 1 (2-start-api-server.py: (context_tp, context_pp, decoding_tp, decoding_pp) "
                 "= (2, 1, 1, 1)), context max tokens per batch 8192 and max batch 128, decoding max batch 1024, FCFS; "
                 "both on one node (the KV over NVLink); the prefill runs at once and holds the KV until the decode "
                 "instance takes it (DistServe's pull: framework/sim/pd.py prefill_after_slots=False)",
    "cost_model": "sim.cost=roofline on hardware=a100_80g (the fitted A100 terms, data/gpu-profiles/fit/a100.json); "
                  "decode attention as multi-head attention reads it (sim.cost.decode_head_block=0: each KV byte "
                  "once; sim.cost.mla_decode_kv_splits=0: no split-K partials), the stand-in's absorbed-MLA FLOPs "
                  "kept (decode steps ~1.3x OPT's at batch 32)",
    "engines": "servelab's scheduler (SGLang v0.4's) stands for vLLM 0.2's and DistServe's; no pipeline parallelism",
}


ROUND2 = {
    "distserve_pull": "sim.pd_order=distserve: the prefill runs at once and its KV waits in the prefill instance "
                      "until the decode instance accepts it (distserve/context_stage_scheduler.py: finished prefills "
                      "go to unaccepted_queue; decoding_stage_scheduler.py post_process pulls them in order)",
    "distserve_decode_admission": "engine.disaggregation_decode_reserve_tokens=0 on the decode instance: DistServe "
                                  "accepts a request when its prompt's blocks fit (decoding_stage_scheduler.py "
                                  "should_accept); no future tokens are reserved, running out swaps a request out "
                                  "(here: SGLang's retract, which recomputes it)",
    "vllm_admission": "engine.init_new_token_ratio=0 on the vLLM instance: vLLM 0.2's scheduler admits a waiting "
                      "request when its prompt's blocks fit (BlockSpaceManager.can_allocate) and preempts by "
                      "recomputation when decoding runs out, reserving no future tokens",
    "dataset": "DistServe's ShareGPT preparation (evaluation/2-benchmark-serving/0-prepare-dataset.py) applied to the "
               "conversations available: at least 3 messages; k uniform in [1, n-1]; the prompt is the first k "
               "messages joined by newlines, the answer message k; pairs with prompt + answer >= 2048 tokens pruned",
    "grid_and_goodput": "as round 1: per-GPU rates every 0.125 req/s, goodput at the first 90% crossing, "
                        "interpolated (the artifact's find_intersection does the same on its coarser grid)",
}


ROUND3 = {
    "vllm_scheduler": "engine.scheduler=vllm_v0_1_7 on the vLLM instance (framework/engine/vllm_policy.py), the rest "
                      "as round 2; DistServe's instances unchanged. The artifact's baseline is "
                      "interestingLSY/vllm branch distserve-baseline-vllm (evaluation/README.md and "
                      "Dockerfile.evaluation at e2d4dca), whose head a4b2b944 (2024-04-29) is vLLM v0.1.7 plus "
                      "timing patches; the notebook printing Figure 8 was committed after it (cc3096f, 2024-04-30). "
                      "Its INSTRUCTIONS.md says v0.2.3 (a sibling branch distserve-baseline-vllm-v0.2.3 holds that), "
                      "whose scheduler differs only by a padded prefill count and max_paddings 256: not taken",
    "vllm_rules": "vllm/core/scheduler.py Scheduler._schedule and vllm/core/block_manager.py at that branch: a step "
                  "is all prefill (waiting requests admitted FCFS from the head, whole prompts, no chunking) or all "
                  "decode; admission stops at the first request whose blocks would leave fewer free than the "
                  "watermark, or past max_num_batched_tokens or max_num_seqs; decode needs a free block per request, "
                  "preempts the latest arrival by recomputation (to the front of the waiting queue); no prefix cache",
    "vllm_settings": "2-start-api-server.py: --block-size 16 (engine.vllm_block_size=16), --max-num-batched-tokens "
                     "16384 (engine.max_prefill_tokens=16384), --max-num-seqs 1024 (engine.max_running_requests=1024), "
                     "-tp 1, --swap-space 16 (used only by multi-sequence requests: the client sends best_of 1); "
                     "BlockSpaceManager's default watermark 0.01 (engine.vllm_watermark=0.01)",
}
SETUP_ROUND3 = {**SETUP,
                "vllm": "one instance, TP 1 (2-start-api-server.py: vllm 1), vLLM v0.1.7's scheduler "
                        "(engine.scheduler=vllm_v0_1_7): block size 16, watermark 0.01, max-num-batched-tokens 16384, "
                        "max-num-seqs 1024, prefill first, no chunked prefill, preemption by recomputation, no prefix "
                        "caching",
                "engines": "vLLM's own scheduler for the vLLM baseline; servelab's (SGLang v0.4's) stands for "
                           "DistServe's; no pipeline parallelism"}


ROUND4 = {
    "step_cost": "sim.cost=distserve_profile (plugins/cost/distserve_profile.py) on every instance, each side priced "
                 "by its own engine's profile: sim.cost.system=vllm on the vLLM instance, sim.cost.system=distserve "
                 "on DistServe's prefill (TP 2) and decode (TP 1) instances. The coefficients "
                 "(experiments/pd_repro/distserve_profile_a100.json) are DistServe's simulator's profile of OPT-13B "
                 "on A100-80GB: LLMServe/DistServe simdistserve/estimators/profile_data/profiler-a100-80g.distserve"
                 ".json and profiler-a100-80g.vllm.json, key facebook/opt-13b, at commit 3261c760 (2024-04-22), "
                 "Apache-2.0; fitted by evaluation/1-fit-time-usage/main.py on single-forward timings "
                 "(evaluation/0-test-single-forward-performance, sut_distserve.py / sut_vllm.py); priced as "
                 "simdistserve/estimators/time_estimator.py lines 26-75 at 82831f16 does (ms: prefill a + b sum(l) "
                 "+ c sum(l^2); decode a + b sum(context + 1) + c batch, small/large batch split at 95)",
    "step_cost_not_taken": "the calibration the simulator's authors added after the profile, against whole serving "
                           "runs (simdistserve/benchmarks/alignment, 20a1633: the real OPT-13B ShareGPT runs behind "
                           "the published curves): 8a653a7's fudge factors (prefill x1.1 DistServe / x1.4 vLLM, vLLM "
                           "decode x1.2, +1 ms per prefill), folded into the profile files by 4c68ed9 (2024-05-01; "
                           "the camera-ready e2d4dca ships those), and worker.py's add_ray_overhead (2 ms + 1e-4 ms "
                           "per context token, ee7fcf3). Not per-step measurements, and fitted to the outcome",
    "step_cost_scope": "the profile has no host, front-end or CUDA-graph terms (simdistserve has none): the roofline's "
                       "SGLang front end and host terms go with it. The KV transfer stays as the roofline prices it "
                       "(simdistserve prices none). Memory (the KV pool) is unchanged: the MLA stand-in's",
    "workload": "unchanged from round 2 (DistServe's 0-prepare-dataset.py on the shipped synthetic sample): no "
                "independent length statistic of DistServe's ShareGPT workload was found. The paper's text is not "
                "reachable here; the artifact's dataset code (0-prepare-dataset.py, 1-analyse-dataset.py, "
                "simdistserve/prepare-dataset.py) states filters, not statistics, and those filters are already "
                "applied. The artifact's per-request lengths exist only inside its recorded serving runs "
                "(simdistserve/benchmarks/alignment/data-ground-truth/*.exp), which also hold the measured latencies "
                "behind the published curves: not read",
}
SETUP_ROUND4 = {**SETUP_ROUND3,
                "cost_model": "sim.cost=distserve_profile: DistServe's artifact's own per-step profile of OPT-13B on "
                              "A100-80GB, each system's for its side (vLLM TP 1; DistServe prefill TP 2, decode TP 1); "
                              "the KV link as the roofline prices it (ROUND4)"}


def distserve_dataset(source: str | None, seed: int) -> tuple[str, dict]:
    """A ShareGPT-format file of DistServe's prepared requests (one exchange each) made from `source` (default: the
    shipped synthetic sample); returns its path and what it holds."""
    src = Path(source) if source else HERE.parents[1] / "data/sharegpt/synthetic_sharegpt.json.gz"
    raw = json.loads((gzip.open(src, "rt") if src.suffix == ".gz" else open(src)).read())
    rng, out = random.Random(seed), []
    for row in raw:
        msgs = [m["value"] for m in row["conversations"]]
        if len(msgs) < 3:
            continue
        k = rng.randint(1, len(msgs) - 1)
        prompt, answer = "\n".join(msgs[:k]), msgs[k]
        if len(prompt.encode()) + len(answer.encode()) >= 2048:   # (the byte tokenizer: a token per byte)
            continue
        out.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]})
    text = json.dumps(out)
    path = Path(tempfile.gettempdir()) / f"distserve_sharegpt_{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    path.write_text(text)
    ins = sorted(len(r["conversations"][0]["value"].encode()) for r in out)
    outs = sorted(len(r["conversations"][1]["value"].encode()) for r in out)
    return str(path), {"source": str(src.relative_to(HERE.parents[1]) if not source else source), "requests": len(out),
                       "sha256": hashlib.sha256(text.encode()).hexdigest(), "prompt_mean": sum(ins) / len(ins),
                       "prompt_p50": ins[len(ins) // 2], "prompt_p90": ins[int(len(ins) * 0.9)],
                       "output_mean": sum(outs) / len(outs)}


ROOFLINE = ["sim.cost=roofline", "sim.cost.decode_head_block=0",    # OPT's MHA: KV read once, no splits
            "sim.cost.mla_decode_kv_splits=0"]
COSTS = ("roofline", "distserve_profile")


def cost_overrides(cost: str, system: str) -> list[str]:
    """Rounds 1-3: the roofline; round 4's switch: DistServe's profile of `system`'s own engine (ROUND4)."""
    return ROOFLINE if cost == "roofline" else ["sim.cost=distserve_profile", f"sim.cost.system={system}"]


def overrides(sharegpt: str | None, n: int, rate: float, cost: list[str] = ROOFLINE) -> list[str]:
    out = ["mode=sim", "logger.mode=disabled", "model=opt13b_mla", "hardware=a100_80g", *cost,
           "workload=sharegpt", f"workload.num_prompts={n if sharegpt else 0}",   # (the sample: all of its 190)
           f"workload.request_rate={rate}",
           "workload.max_concurrency=0", "workload.max_output_len=0", "workload.max_prompt_len=2047",
           "workload.max_total_len=2048", "workload.slo.ttft_ms=250", "workload.slo.tpot_ms=100",
           "router=round_robin", "engine.radix_cache=false", f"engine.mem_budget_mb={MEM_MB}",
           "engine.schedule_policy=fcfs",
           "engine.max_running_requests=1024", "sim.itl=true"]
    return out + ([f"workload.path={sharegpt}"] if sharegpt else [])


def run_sim(instances: dict, cfg, sessions, roles: dict | None, cfgs: dict, rnd: int = 1) -> dict:
    names = list(instances)
    policy_cfg, service = split_router_config(cfg.router)
    router = SimRouter(ROUTING.get(cfg.router.name)(policy_cfg, cfg.seed), names, service.maintain_interval_secs, 0,
                       service.load_poll_interval_s)
    s = cfg.sim
    sim = Simulation(instances, router, sessions, cfg.workload, instances[names[0]].tokenizer,
                     network_s=s.network_latency_s, router_s=s.router_overhead_s, fast_forward=s.fast_forward)
    if roles:
        # DistServe's order: the prefill runs at once and its instance holds the KV until the decode side pulls it
        # (round 1 set the order in code; from round 2 the run's sim.pd_order does)
        sim.pd = PD(sim, roles, cfgs, instances[names[0]].cost, cfg.router,
                    prefill_after_slots=False if rnd == 1 else None)
    records, duration = sim.run()
    res = summarize(records, duration, cfg.workload.slo)
    if sim.pd:
        res.update(sim.pd.describe())
    return res


def vllm_instance(sharegpt, n, rate_per_gpu, rnd: int = 1, cost: str = "roofline") -> tuple:
    """The vLLM baseline's run config, its requests and its one simulated instance."""
    extra = ["engine.init_new_token_ratio=0"] if rnd >= 2 else []
    if rnd >= 3:      # vLLM's own scheduler (ROUND3); the ratio above then has no effect
        extra += ["engine.scheduler=vllm_v0_1_7", "engine.vllm_block_size=16", "engine.vllm_watermark=0.01"]
    cfg = compose(overrides(sharegpt, n, rate_per_gpu, cost_overrides(cost, "vllm"))
                  + ["parallel=single", "cluster.instances=1", "engine.chunked_prefill_tokens=16384",
                     "engine.max_prefill_tokens=16384"] + extra)
    sessions = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    return cfg, sessions, {"sim://vllm-0": SimInstance("sim://vllm-0", cfg, cost_model(cfg), cfg.seed)}


def vllm(sharegpt, n, rate_per_gpu, rnd: int = 1, cost: str = "roofline") -> dict:
    cfg, sessions, inst = vllm_instance(sharegpt, n, rate_per_gpu, rnd, cost)
    return run_sim(inst, cfg, sessions, None, {}, rnd)


def distserve(sharegpt, n, rate_per_gpu, rnd: int = 1, cost: str = "roofline") -> dict:
    rate = 3 * rate_per_gpu                                   # 3 GPUs: per-GPU rate x 3
    base = overrides(sharegpt, n, rate, cost_overrides(cost, "distserve")) + ["cluster.instances=2",
                                                                              "cluster.roles=[prefill,decode]"]
    if rnd >= 2:
        base.append("sim.pd_order=distserve")
    cfg_p = compose(base + ["parallel=tp", "parallel.size=2", "engine.chunked_prefill_tokens=8192",
                            "engine.max_prefill_tokens=8192", "engine.max_running_requests=128"])
    cfg_d = compose(base + ["parallel=single"] + (["engine.disaggregation_decode_reserve_tokens=0"] if rnd >= 2 else []))
    cfgs = {"sim://prefill-0": instance_config(cfg_p, Role.prefill), "sim://decode-0": instance_config(cfg_d, Role.decode)}
    roles = {"sim://prefill-0": Role.prefill, "sim://decode-0": Role.decode}
    sessions = WORKLOAD.build(cfg_d.workload.name, cfg_d.workload, cfg_d.seed).sessions()
    inst = {n_: SimInstance(n_, c, cost_model(c), c.seed) for n_, c in cfgs.items()}
    return run_sim(inst, cfg_d, sessions, roles, cfgs, rnd)


def goodput(curve: list[tuple[float, float]]) -> float:
    """The highest per-GPU rate with attainment >= ATTAINMENT, interpolated between the grid's points (the first
    crossing from above)."""
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0)] + curve, curve):
        if a1 >= ATTAINMENT:
            best = r1
            continue
        if a0 >= ATTAINMENT:
            best = r0 + (r1 - r0) * (a0 - ATTAINMENT) / (a0 - a1)
        break
    return best


def curve(name: str, fn, sharegpt, n: int, rates: list[float], rnd: int, cost: str = "roofline") -> dict:
    """One system's attainment against the per-GPU rate, until past its knee, and its goodput."""
    points, rows = [], []
    for r in rates:
        res = fn(sharegpt, n, r, rnd, cost)
        points.append((r, res["slo_attainment"]))
        rows.append({"rate_per_gpu": r, "slo_attainment": res["slo_attainment"],
                     "ttft_p90_ms": res["ttft_p90_ms"], "tpot_p90_ms": res["tpot_p90_ms"],
                     **{k: v for k, v in res.items() if k.startswith("pd_transfer_p")}})
        print(f"{name:>9} {cost:>17} {r:6.3f} req/s/GPU  attainment {res['slo_attainment']:.3f}  "
              f"TTFT p90 {res['ttft_p90_ms']:8.1f} ms  TPOT p90 {res['tpot_p90_ms']:7.1f} ms", flush=True)
        below = [a for _, a in points[-4:] if a < ATTAINMENT]
        if res["slo_attainment"] < 0.5 or len(below) == 4:   # past the knee: the goodput is settled
            break
    return {"curve": rows, "goodput_per_gpu": goodput(points)}


def sensitivity(sharegpt, n: int, rates: list[float], rnd: int, systems: dict) -> dict:
    """Round 4's change alone and per side: each system's goodput under round 3's cost (the roofline) beside the
    prediction's (DistServe's profile), and the ratio of every pairing. The one other change round 4 could have made
    (the workload's lengths) has no source (ROUND4['workload']), so there is no second change to run alone."""
    base = {name: curve(name, fn, sharegpt, n, rates, rnd, "roofline")["goodput_per_gpu"]
            for name, fn in (("vllm", vllm), ("distserve", distserve))}
    new = {name: systems[name]["goodput_per_gpu"] for name in systems}
    pairs = {f"vllm_{cv}__distserve_{cd}": (new if cd == COSTS[1] else base)["distserve"] /
             (new if cv == COSTS[1] else base)["vllm"] for cv in COSTS for cd in COSTS}
    r3 = HERE / "predictions_round3.json"
    same = (json.loads(r3.read_text())["predicted"] if r3.exists() else {})
    return {"goodput_per_gpu": {"roofline": base, "distserve_profile": new}, "distserve_over_vllm": pairs,
            "roofline_equals_round3": same.get("vllm_goodput_per_gpu") == base["vllm"]
            and same.get("distserve_goodput_per_gpu") == base["distserve"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sharegpt", default=None)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="a coarse grid (a smoke run, not the prediction)")
    ap.add_argument("--round", type=int, default=1, choices=(1, 2, 3, 4))
    args = ap.parse_args()
    sharegpt, dataset = args.sharegpt, None
    if args.round >= 2:     # DistServe's preparation: a file of its prompts (the seed: the runs' own, 0)
        sharegpt, dataset = distserve_dataset(args.sharegpt, seed=0)
    step = 0.5 if args.quick else 0.125
    rates = [round(step * k, 3) for k in range(1, int(12 / step) + 1)]   # until attainment falls below 0.5
    setup = SETUP_ROUND4 if args.round >= 4 else SETUP_ROUND3 if args.round >= 3 else SETUP
    out = {"setup": setup, "dataset": args.sharegpt or "data/sharegpt/synthetic_sharegpt.json.gz (a stand-in: "
           "synthetic lengths, not ShareGPT's)",
           "requests_per_rate": args.requests if args.round == 1 or args.sharegpt else dataset["requests"],
           "attainment_target": ATTAINMENT,
           "round": args.round, "systems": {}}
    if args.round >= 2:
        out["round2_changes"], out["prepared_dataset"] = ROUND2, dataset
    if args.round >= 3:
        out["round3_changes"] = ROUND3
    if args.round >= 4:
        out["round4_changes"] = ROUND4
    n = args.requests if args.round == 1 or args.sharegpt else 0
    cost = "distserve_profile" if args.round >= 4 else "roofline"
    t0 = time.time()
    for name, fn in (("vllm", vllm), ("distserve", distserve)):
        out["systems"][name] = curve(name, fn, sharegpt, n, rates, args.round, cost)
    v, d = out["systems"]["vllm"]["goodput_per_gpu"], out["systems"]["distserve"]["goodput_per_gpu"]
    out["predicted"] = {"vllm_goodput_per_gpu": v, "distserve_goodput_per_gpu": d,
                        "distserve_over_vllm": d / v if v else None}
    if args.round >= 4:
        out["sensitivity"] = sens = sensitivity(sharegpt, n, rates, args.round, out["systems"])
        print("\nsensitivity (per-GPU goodput, req/s/GPU; ratio DistServe / vLLM):")
        print(f"{'cost model':<18} {'vLLM':>8} {'DistServe':>10}")
        for c in COSTS:
            g = sens["goodput_per_gpu"][c]
            print(f"{c:<18} {g['vllm']:>8.3f} {g['distserve']:>10.3f}")
        for pair, ratio in sens["distserve_over_vllm"].items():
            print(f"  {pair:<52} {ratio:6.2f}x")
        print(f"  roofline runs equal predictions_round3.json: {sens['roofline_equals_round3']}")
    wall = time.time() - t0
    if args.round <= 2:
        out["sim_wall_s"] = wall       # (rounds 1-2 kept it; from round 3 the file is byte-for-byte reproducible)
    name = "predictions.json" if args.round == 1 else f"predictions_round{args.round}.json"
    if args.quick:
        name = name.replace(".json", "_quick.json")   # a smoke run never overwrites a registered prediction
    (HERE / name).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\npredicted per-GPU goodput (>= {ATTAINMENT:.0%} within TTFT 0.25 s and TPOT 0.1 s): vLLM {v:.3f}, "
          f"DistServe {d:.3f} req/s/GPU, ratio {out['predicted']['distserve_over_vllm'] or float('nan'):.2f}x "
          f"({wall:.0f} s of simulation)")


if __name__ == "__main__":
    main()
