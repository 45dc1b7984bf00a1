"""What the CUDA-graph DP test runs inside each spawned rank (module level: ranks import it by name)."""
from __future__ import annotations

from framework.dist.group import Group
from framework.engine.config import EngineConfig
from framework.engine.cuda_graph import EagerCapture
from framework.instance.rank_loop import InstanceSpec, build_rank_engine, control_group
from framework.engine.request import Req, SamplingParams
from framework.model.config import ModelConfig
from plugins.moe.triton_fused import TritonFusedConfig
from plugins.parallelism.dp_attn import DPAttnConfig

WIDTH = 40   # engine.cuda_graph_max_context
# (prompt length, max_new_tokens) per DP rank: rank 0's first prompt is longer than WIDTH (its 2 decode steps go
# eager: context) and finishes before its 2 short ones; rank 1's 9 requests finish early, leaving it IDLE
DP_PLAN = [[(50, 3), (6, 10), (7, 10)], [(5 + i, 5) for i in range(9)]]


def dp_decode(group: Group, plan: list[list[tuple[int, int]]]) -> dict:
    """Serve this rank's requests to the end on an engine whose graphs are 'captured' by EagerCapture; each step's
    (rows, synced counts, bucket, eager reason) and each request's (prompt, output, logits rows)."""
    engine_cfg = EngineConfig(device="cpu", max_running_requests=128, cuda_graph_max_context=WIDTH,
                              cuda_graph_dp_attention_max_bs=96)   # v0.4.0's cap: the largest bucket 96
    spec = InstanceSpec(ModelConfig(), engine_cfg, DPAttnConfig(size=group.size), TritonFusedConfig())
    engine = build_rank_engine(spec, group, control_group(group, 60.0))
    engine.graphs.capture(EagerCapture())
    decisions, decide = [], engine.graphs.decide

    def recorded(batch):
        decision = decide(batch)
        decisions.append((len(batch.reqs), list(batch.global_num_tokens or []), decision.bucket, decision.reason))
        return decision
    engine.graphs.decide = recorded
    logits: dict[str, list] = {}
    engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row)
    reqs = [Req([(7 * j + n) % 256 for j in range(n)], SamplingParams(max_new_tokens=m, ignore_eos=True))
            for n, m in plan[engine.par.dp_rank]]
    for r in reqs:
        engine.add(r)
    while True:   # every rank steps until no rank has work (sync_step returns None on all ranks at once)
        if engine.step() is None and not engine.scheduler.has_work():
            break
    import torch
    return {"sizes": engine.graphs.sizes, "decisions": decisions,
            "outputs": [(r.prompt_ids, r.output_ids, torch.stack(logits[r.rid])) for r in reqs]}
