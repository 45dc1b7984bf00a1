"""mode=verify: the engine's incremental path (chunked prefill, decode over the KV cache in absorbed form,
radix-cache hits, retraction and resume) against the single-process `reference_forward`, logits compared."""
from __future__ import annotations

import dataclasses
import random

import torch

from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.model.model import build_model
from framework.model.reference import reference_forward
from framework.workload.base import random_text


def verify_prompts(seed: int, n: int = 6) -> list[str]:
    """Prompts with a shared prefix, varied lengths (one longer than a prefill chunk) and a one-character one."""
    rng = random.Random(seed)
    shared = random_text(rng, 48)
    prompts = [shared + random_text(rng, rng.randint(4, 40)) for _ in range(n - 2)]
    return prompts + [random_text(rng, 150), "x"]


def run_case(engine: Engine, reference, prompts: list[str], max_new_tokens: int, repeat: int = 2) -> dict:
    """Serve the prompts `repeat` times (later rounds hit the radix cache); compare every sampled token's logits."""
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row)
    reqs = []
    for _ in range(repeat):
        batch = [Req(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
                 for p in prompts]
        for r in batch:
            engine.add(r)
        while engine.scheduler.has_work():
            engine.step()
        reqs += batch
    engine.logit_hook = None
    err = 0.0
    for r in reqs:
        expect = reference_forward(reference, r.prompt_ids + r.output_ids[:-1])[len(r.prompt_ids) - 1:]
        err = max(err, (expect.float().cpu() - torch.stack(logits[r.rid])).abs().max().item())
    return {"max_abs_err": err, "requests": len(reqs), "cached_tokens": sum(r.cached_tokens for r in reqs),
            "retractions": engine.scheduler.stats["retractions"]}


def verify_single(cfg, par, group) -> dict[str, dict]:
    """The cases on one rank: plain, chunked prefill with cache hits, tight KV (retraction), no radix cache."""
    reference = build_model(cfg.model, cfg.seed)
    prompts = verify_prompts(cfg.seed)
    n_tok = cfg.verify.max_new_tokens
    kv_per_token = cfg.model.kv_bytes_per_token()
    cases = {
        "radix_cache": dataclasses.replace(cfg.engine),
        "chunked_prefill": dataclasses.replace(cfg.engine, chunked_prefill_tokens=16),
        "tight_kv_retract": dataclasses.replace(cfg.engine, kv_budget_mb=200 * kv_per_token / 2**20,
                                                new_token_ratio=0.05, min_new_token_ratio=0.0),
        "no_radix_cache": dataclasses.replace(cfg.engine, radix_cache=False),
    }
    results = {}
    for name, engine_cfg in cases.items():
        engine = Engine(cfg.model, engine_cfg, par, cfg.moe, cfg.seed)
        results[name] = run_case(engine, reference, prompts, n_tok)
    return results
