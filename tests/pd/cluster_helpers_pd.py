"""Configs of a P/D cluster for these tests, and a mixed instance's answer to compare with."""
from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from cluster_helpers import compose  # noqa: E402

from framework.engine.request import SamplingParams  # noqa: E402
from framework.instance.client import open_engine  # noqa: E402
from framework.instance.rank_loop import InstanceSpec  # noqa: E402
from pd_helpers import collect  # noqa: E402


def compose_pd(*overrides: str):
    """One prefill and one decode worker behind sglang-router's P/D mode, on free ports, restarts off, one retry,
    a room unanswered for 3 s fails."""
    return compose("cluster.instances=2", "cluster.roles=[prefill,decode]", "router.port=0", "engine.kv_budget_mb=1",
                   "engine.device=cpu", "router=round_robin", "router.impl=sglang", "cluster.restart_workers=false",
                   "router.max_retries=1", "engine.disaggregation_timeout_s=3", *overrides)


def mixed_text(cfg, prompt: str, n: int) -> str:
    """What one mixed instance of the same model answers (greedy, n tokens)."""
    client = open_engine(InstanceSpec(cfg.model, dataclasses.replace(cfg.engine, role="mixed"), cfg.parallel,
                                      cfg.moe, cfg.seed))
    try:
        tokens, _ = asyncio.run(collect(client, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        return client.tokenizer.decode(tokens)
    finally:
        client.close()
