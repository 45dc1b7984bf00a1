"""mode=verify: the engine's incremental path (chunked prefill, decode over the KV cache in absorbed form,
radix-cache hits, retraction and resume) against the single-process `reference_forward`, logits compared.

At parallel.size > 1 the same cases run on a multi-rank instance (framework.instance.rank_loop): every rank's logits
of every token it sampled are compared with the reference, and the instance protocol is checked too: each request
served by exactly one DP group, every rank of a group serving all of its requests and sampling the same tokens, and
the parallelism plugin's own per-step checks (`check_step_logs`; DP attention: lockstep with the same token counts,
IDLE batches exactly where a rank had none, can_run_graph exactly when every rank was in decode or idle).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from framework.engine.engine import Engine
from framework.instance.handle import SyncFace
from framework.engine.request import Req, SamplingParams
from framework.engine.stats import instance_stats
from framework.engine.step import instance_log
from framework.model.model import build_model
from framework.model.reference import reference_forward
from framework.core.registry import PARALLELISM
from framework.contracts.workload import random_text

REPEAT = 2   # each case serves its prompts twice: the second round hits the radix cache
PINNED_CASES = ("chunked_prefill", "tight_kv_retract")   # several DP groups: uneven loads, a group with no request
SAMPLED_CASES = ("no_radix_cache",)   # temperature sampling: the ranks of a group must still draw the same tokens
RETRACT_MAX_NEW_TOKENS = 12   # tight_kv_retract: decodes long enough to outgrow what admission reserved for them


def reference_model(cfg):
    """The oracle's model: the engine's weights (rounded to model.dtype, as the engine holds them), computed in
    float32, so a bfloat16 engine is measured against exact arithmetic on its own model rather than against a second
    bfloat16 rounding."""
    return build_model(cfg.model, cfg.seed).float()


def verify_prompts(seed: int, n: int = 6) -> list[str]:
    """Prompts with a shared prefix, varied lengths (one longer than a prefill chunk) and a one-character one."""
    rng = random.Random(seed)
    shared = random_text(rng, 48)
    prompts = [shared + random_text(rng, rng.randint(4, 40)) for _ in range(n - 2)]
    return prompts + [random_text(rng, 150), "x"]


def engine_cases(cfg) -> dict:
    """The engine settings each case runs with: plain, chunked prefill with cache hits, tight KV (retraction),
    no radix cache. tight_kv_retract: 180 tokens of KV per rank and 16-token chunks, so requests join while earlier
    ones still have decodes ahead, which admission reserves only new_token_ratio (0.05) of: it retracts."""
    kv_per_token = cfg.model.kv_bytes_per_token()
    return {
        "radix_cache": dataclasses.replace(cfg.engine),
        "chunked_prefill": dataclasses.replace(cfg.engine, chunked_prefill_tokens=16),
        "tight_kv_retract": dataclasses.replace(cfg.engine, kv_budget_mb=180 * kv_per_token / 2**20,
                                                chunked_prefill_tokens=16, init_new_token_ratio=0.05,
                                                min_new_token_ratio_factor=0.0),
        "no_radix_cache": dataclasses.replace(cfg.engine, radix_cache=False),
    }


def case_max_new_tokens(name: str, max_new_tokens: int) -> int:
    return max(max_new_tokens, RETRACT_MAX_NEW_TOKENS) if name == "tight_kv_retract" else max_new_tokens


def logits_error(reference, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> float:
    """Max abs difference between the logits the engine sampled from and the reference's at the same positions."""
    expect = reference_forward(reference, prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:]
    return (expect.float().cpu() - logits.float().cpu()).abs().max().item()


def _new_reqs(tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0) -> list[Req]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=0.9 if temperature else 1.0, ignore_eos=True)
    return [Req(tokenizer.encode(p), dataclasses.replace(params)) for p in prompts]


def run_case(engine: Engine, reference, prompts: list[str], max_new_tokens: int, repeat: int = REPEAT,
             temperature: float = 0.0) -> dict:
    """Serve the prompts `repeat` times (later rounds hit the radix cache); compare every sampled token's logits."""
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row)
    reqs = []
    for _ in range(repeat):
        batch = _new_reqs(engine.tokenizer, prompts, max_new_tokens, temperature)
        for r in batch:
            engine.add(r)
        while engine.scheduler.has_work():
            engine.step()
        reqs += batch
    engine.logit_hook = None
    err = max(logits_error(reference, r.prompt_ids, r.output_ids, torch.stack(logits[r.rid])) for r in reqs)
    return {"max_abs_err": err, "requests": len(reqs), "cached_tokens": sum(r.cached_tokens for r in reqs),
            "retractions": engine.scheduler.stats["retractions"]}


def verify_single(cfg, par) -> dict[str, dict]:
    """The cases on one rank."""
    reference = reference_model(cfg)
    prompts = verify_prompts(cfg.seed)
    results = {}
    for name, engine_cfg in engine_cases(cfg).items():
        engine = Engine(cfg.model, engine_cfg, par, cfg.moe, cfg.seed)
        results[name] = run_case(engine, reference, prompts, case_max_new_tokens(name, cfg.verify.max_new_tokens),
                                 temperature=0.8 if name in SAMPLED_CASES else 0.0)
    return results


# -- multi-rank -------------------------------------------------------------------------------------------------
def dp_pin(case: str, i: int, dp_size: int) -> int | None:
    """Several DP groups, pinned cases. chunked_prefill: odd requests to group 0, even ones spread over groups
    0..dp_size-2, none at all to group dp_size-1 (uneven loads, and ranks that only ever run IDLE batches).
    tight_kv_retract: all on group 0, whose small pool then retracts and resumes while the others idle. Other cases
    leave the choice to rank 0's dispatcher."""
    if case not in PINNED_CASES or dp_size == 1:
        return None
    if case == "tight_kv_retract":
        return 0
    return 0 if i % 2 else (i // 2) % (dp_size - 1)


def verify_instance(cfg, cases: dict | None = None, traces: dict | None = None) -> dict[str, dict] | None:
    """The cases on one `parallel.size`-rank instance (spawned once; a fresh engine per case on every rank).
    `cases`: name -> (EngineConfig, MoE config), default: `engine_cases` with cfg.moe. `traces`: filled with each
    case's `step_trace` when given. Under torchrun, ranks > 0 serve and return None; rank 0 checks every rank's
    logits."""
    from framework.instance.rank_loop import InstanceSpec, verify_rank
    from framework.instance.client import open_engine
    if cases is None:
        cases = {name: (engine_cfg, cfg.moe) for name, engine_cfg in engine_cases(cfg).items()}
    spec = InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed,
                        cases=[(name, *case) for name, case in cases.items()])
    plugin = PARALLELISM.get(cfg.parallel.name)
    prompts, dp_size = verify_prompts(cfg.seed), plugin.dp_size(cfg.parallel)
    client = open_engine(spec, fn=verify_rank)
    if client is None:
        return None
    face, sent = SyncFace(client), {}
    try:
        for k, name in enumerate(cases):
            if k:
                client.wait_ready()
            sent[name] = []
            for _ in range(REPEAT):
                reqs = _new_reqs(client.tokenizer, prompts, case_max_new_tokens(name, cfg.verify.max_new_tokens),
                                 0.8 if name in SAMPLED_CASES else 0.0)
                # a round at once, as verify_single adds it before stepping: tight_kv_retract retracts only when
                # its requests decode together, which requests sent one by one on a loaded host may not
                face.add_together(reqs, [dp_pin(name, i, dp_size) for i in range(len(reqs))])
                face.wait_all(reqs)
                sent[name] += reqs
            if k + 1 < len(cases):
                client.stop_loop()
        per_rank = client.close_ranks()
    finally:
        client.terminate()
    reference = reference_model(cfg)
    groups = [plugin.dp_rank_of(cfg.parallel, r) for r in range(cfg.parallel.size)]
    if traces is not None:
        traces.update({name: step_trace([r[name] for r in per_rank], groups) for name in cases})
    return {name: _check_case(name, [r[name] for r in per_rank], sent[name], reference, plugin, groups)
            for name in cases}


def step_trace(ranks: list[dict], groups: list[int]) -> dict:
    """What a replay of one case needs (tests/sim/test_step_oracle.py): the instance's step log (each DP group's part
    from its first rank), its arrivals, (step round, DP group, request id, prompt ids, sampling parameters) in the
    order they were added, and each request's output ids. ranks[r]: rank r's results of the case; groups[r]: its DP
    group."""
    leaders = [r for r in range(len(ranks)) if r == 0 or groups[r - 1] != groups[r]]
    arrivals = sorted(((at, groups[r], rid, prompt, params) for r in leaders
                       for at, rid, prompt, params in ranks[r]["arrivals"]), key=lambda a: a[0])
    outputs = {rid: output_ids for r in leaders for rid, (_, output_ids) in ranks[r]["requests"].items()}
    return {"log": instance_log([res["step_log"] for res in ranks], leaders), "arrivals": arrivals,
            "outputs": outputs}


def _check_case(name: str, ranks: list[dict], sent: list[Req], reference, plugin, groups: list[int]) -> dict:
    """ranks[r]: rank r's results of this case; groups[r]: its DP group."""
    problems, err, expect_cache = [], 0.0, {}
    for res in ranks:
        for rid, (prompt_ids, output_ids) in res["requests"].items():
            key = (tuple(prompt_ids), tuple(output_ids))
            if key not in expect_cache:
                expect_cache[key] = reference_forward(reference, prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:]
            err = max(err, (expect_cache[key].float() - res["logits"][rid].float()).abs().max().item())
    outputs = [{rid: o for rid, (_, o) in res["requests"].items()} for res in ranks]
    leaders = [r for r in range(len(ranks)) if r == 0 or groups[r - 1] != groups[r]]
    for r, g in enumerate(groups):
        if outputs[r] != outputs[groups.index(g)]:
            problems.append(f"rank {r} served other requests or sampled other tokens than its DP group's first rank")
    served = [set(outputs[r]) for r in leaders]
    want = {r.rid for r in sent}
    if sum(len(s) for s in served) != len(want) or set().union(*served) != want:
        problems.append(f"the DP groups did not serve each request exactly once: {[len(s) for s in served]}")
    if name in PINNED_CASES and len(leaders) > 1 and served[-1]:
        problems.append(f"DP group {len(leaders) - 1} was meant to get no request")
    problems += plugin.check_step_logs([res["step_log"] for res in ranks])
    parent = {r.rid: r.output_ids for r in sent}
    for rid, output_ids in (item for r in leaders for item in outputs[r].items()):
        if parent[rid] != output_ids:
            problems.append(f"request {rid}: the parent received other tokens than the rank sampled")
    stats = instance_stats([res["stats"] for res in ranks], ranks[0]["stats"]["instance_peak_running"])
    keep = ("retractions", "idle_steps", "steps", "graph_eligible_steps", "kv_capacity_tokens_per_rank",
            "kv_capacity_tokens_instance")
    return {"max_abs_err": err, "requests": len(sent), "cached_tokens": sum(r.cached_tokens for r in sent),
            **{k: stats[k] for k in keep}, "requests_per_rank": [len(o) for o in outputs], "problems": problems}


def run(cfg, out_dir: str, resolved: dict) -> float:
    """mode=verify: every case's logits against the reference; fails above verify.atol or on a protocol problem.
    Returns the worst logit error."""
    from framework.dist.group import Group
    from framework.runs.checks import check_instance, instance_errors, parallelism
    from framework.runs.finish import finish
    from framework.runs.progress import phase
    check_instance(cfg)
    phase(f"verifying {len(engine_cases(cfg))} cases on {cfg.parallel.size} rank(s) against the reference")
    if cfg.parallel.size == 1:
        cases = verify_single(cfg, parallelism(cfg)(cfg.parallel, Group()))
    else:
        with instance_errors(f"verify on the {cfg.parallel.size}-rank instance"):
            cases = verify_instance(cfg)
        if cases is None:                       # torchrun, rank > 0: rank 0 reports
            return 0.0
    worst = max(c["max_abs_err"] for c in cases.values())
    problems = [f"{name}: {p}" for name, c in cases.items() for p in c.get("problems", [])]
    results = {"verify_max_abs_err": worst, "verify_atol": cfg.verify.atol,
               "verify_passed": worst <= cfg.verify.atol and not problems, **parallelism(cfg).describe(cfg.parallel)}
    for name, c in cases.items():
        results.update({f"{name}_{k}": v for k, v in c.items() if k not in ("problems", "requests")})
    failure = (f"verify failed: max abs logit error {worst:.3g} > verify.atol {cfg.verify.atol:g}"
               if worst > cfg.verify.atol else "verify failed: " + "; ".join(problems) if problems else None)
    finish(cfg, out_dir, resolved, f"verify: parallel={cfg.parallel.name} x{cfg.parallel.size} moe={cfg.moe.name}",
           results, failure=failure, headline="verify_max_abs_err")
    print(f"verify passed: max abs logit error {worst:.3g} <= verify.atol {cfg.verify.atol:g}")
    return worst
