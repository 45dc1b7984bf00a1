"""mode=verify: the engine's incremental path (chunked prefill, decode over the KV cache in absorbed form,
radix-cache hits, retraction and resume) against the single-process `reference_forward`, logits compared.

At parallel.size > 1 the same cases run on a multi-rank instance (framework.engine.instance): every rank's logits
of every token it sampled are compared with the reference, and the instance protocol is checked too (each request
served exactly once; TP ranks agree token for token; DP attention ranks step in lockstep with the same token counts,
IDLE batches exactly where a rank had none, and can_run_graph exactly when every rank was in decode or idle).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.model.model import build_model
from framework.model.reference import reference_forward
from framework.registry import PARALLELISM
from framework.workload.base import random_text

REPEAT = 2   # each case serves its prompts twice: the second round hits the radix cache
PINNED_CASES = ("chunked_prefill", "tight_kv_retract")   # DP attention: uneven loads and a rank with no request
SAMPLED_CASES = ("no_radix_cache",)   # temperature sampling: TP ranks must still draw the same tokens
RETRACT_MAX_NEW_TOKENS = 12   # tight_kv_retract: decodes long enough to outgrow what admission reserved for them


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


def verify_single(cfg, par, group) -> dict[str, dict]:
    """The cases on one rank."""
    reference = build_model(cfg.model, cfg.seed)
    prompts = verify_prompts(cfg.seed)
    results = {}
    for name, engine_cfg in engine_cases(cfg).items():
        engine = Engine(cfg.model, engine_cfg, par, cfg.moe, cfg.seed)
        results[name] = run_case(engine, reference, prompts, case_max_new_tokens(name, cfg.verify.max_new_tokens),
                                 temperature=0.8 if name in SAMPLED_CASES else 0.0)
    return results


# -- multi-rank -------------------------------------------------------------------------------------------------
def dp_pin(case: str, i: int, size: int) -> int | None:
    """DP attention, pinned cases. chunked_prefill: odd requests to rank 0, even ones spread over ranks 0..size-2,
    none at all to rank size-1 (uneven loads, and a rank that only ever runs IDLE batches). tight_kv_retract: all on
    rank 0, whose small pool then retracts and resumes while the others idle. Other cases leave the choice to the
    DataParallelController."""
    if case not in PINNED_CASES or size == 1:
        return None
    if case == "tight_kv_retract":
        return 0
    return 0 if i % 2 else (i // 2) % (size - 1)


def verify_instance(cfg, cases: dict | None = None) -> dict[str, dict] | None:
    """The cases on one `parallel.size`-rank instance (spawned once; a fresh engine per case on every rank).
    `cases`: name -> (EngineConfig, MoE config), default: `engine_cases` with cfg.moe. Under torchrun, ranks > 0
    serve and return None; rank 0 checks every rank's logits."""
    from framework.engine.instance import InstanceSpec, verify_rank
    from framework.engine.instance_client import open_client
    if cases is None:
        cases = {name: (engine_cfg, cfg.moe) for name, engine_cfg in engine_cases(cfg).items()}
    spec = InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed,
                        cases=[(name, *case) for name, case in cases.items()])
    prompts, size = verify_prompts(cfg.seed), cfg.parallel.size
    client = open_client(spec, fn=verify_rank)
    if client is None:
        return None
    sent: dict[str, list[Req]] = {}
    try:
        for k, name in enumerate(cases):
            if k:
                client.wait_ready()
            sent[name] = []
            for _ in range(REPEAT):
                reqs = _new_reqs(client.tokenizer, prompts, case_max_new_tokens(name, cfg.verify.max_new_tokens),
                                 0.8 if name in SAMPLED_CASES else 0.0)
                for i, r in enumerate(reqs):
                    client.add(r, dp_rank=dp_pin(name, i, size))
                client.wait_all(reqs)
                sent[name] += reqs
            if k + 1 < len(cases):
                client.stop_loop()
        per_rank = client.close()
    finally:
        client.terminate()
    reference = build_model(cfg.model, cfg.seed)
    replicated = PARALLELISM.get(cfg.parallel.name).replicates_batch
    return {name: _check_case(name, [r[name] for r in per_rank], sent[name], reference, replicated, size)
            for name in cases}


def _check_case(name: str, ranks: list[dict], sent: list[Req], reference, replicated: bool, size: int) -> dict:
    problems, err, expect_cache = [], 0.0, {}
    for rank, res in enumerate(ranks):
        for rid, (prompt_ids, output_ids) in res["requests"].items():
            key = (tuple(prompt_ids), tuple(output_ids))
            if key not in expect_cache:
                expect_cache[key] = reference_forward(reference, prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:]
            got = res["logits"][rid]
            err = max(err, (expect_cache[key].float() - got.float()).abs().max().item())
    served = [set(res["requests"]) for res in ranks]
    want = {r.rid for r in sent}
    if replicated:
        if any(s != want for s in served):
            problems.append("a TP rank did not serve every request")
        outputs = [{rid: o for rid, (_, o) in res["requests"].items()} for res in ranks]
        if any(o != outputs[0] for o in outputs):
            problems.append("TP ranks sampled different tokens")
    else:
        if sum(len(s) for s in served) != len(want) or set().union(*served) != want:
            problems.append(f"DP ranks did not serve each request exactly once: {[len(s) for s in served]}")
        if name in PINNED_CASES and size > 1 and served[-1]:
            problems.append(f"rank {size - 1} was meant to get no request")
        problems += _check_dp_steps(ranks)
    parent = {r.rid: r.output_ids for r in sent}
    for res in ranks[:1] if replicated else ranks:
        for rid, (_, output_ids) in res["requests"].items():
            if parent[rid] != output_ids:
                problems.append(f"request {rid}: the parent received other tokens than the rank sampled")
    stats = [res["stats"] for res in ranks]
    return {"max_abs_err": err, "requests": len(sent), "cached_tokens": sum(r.cached_tokens for r in sent),
            "retractions": sum(s["retractions"] for s in (stats[:1] if replicated else stats)),
            "idle_steps": sum(s["idle_steps"] for s in stats), "steps": stats[0]["steps"],
            "graph_eligible_steps": stats[0]["graph_eligible_steps"],
            "kv_capacity_tokens_per_rank": stats[0]["kv_capacity_tokens"],
            "kv_capacity_tokens_instance": sum(s["kv_capacity_tokens"] for s in (stats[:1] if replicated else stats)),
            "requests_per_rank": [len(s) for s in served], "problems": problems}


def _check_dp_steps(ranks: list[dict]) -> list[str]:
    """The sync protocol from the ranks' step logs (index i = the same step on every rank)."""
    logs = [res["step_log"] for res in ranks]
    if len({len(log) for log in logs}) != 1:
        return [f"DP ranks ran different numbers of steps: {[len(log) for log in logs]}"]
    for i, step in enumerate(zip(*logs)):
        counts = step[0]["counts"]
        if any(s["counts"] != counts for s in step):
            return [f"step {i}: ranks saw different token counts"]
        if counts == [0] * len(counts):
            return [f"step {i}: a step ran although every rank had 0 tokens"]
        for rank, s in enumerate(step):
            if (s["mode"] == "idle") != (counts[rank] == 0):
                return [f"step {i}: rank {rank} ran {s['mode']} with {counts[rank]} tokens"]
        graph = all(s["mode"] in ("decode", "idle") for s in step)
        if any(s["can_run_graph"] != graph for s in step):
            return [f"step {i}: can_run_graph disagrees with the ranks' modes"]
    return []
