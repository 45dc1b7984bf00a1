"""CUDA-graph decode (framework/engine/cuda_graph.py) on a CPU: the runner's decisions, padding and DP agreement, with
the capture stood in by `EagerCapture` (a 'replay' reruns the captured function on the static buffers and overwrites
its output, as a graph does), checked against the engine without graphs and against the reference model. Numerics
under a real CUDA graph: tests/gpu/test_cuda_graph_decode.py."""
import logging

import pytest
import torch

from framework.dist import launch
from framework.dist.group import Group
from framework.contracts.batch import ForwardBatch, ForwardMode
from framework.engine.config import EngineConfig
from framework.engine.cuda_graph import GRAPH_COUNTERS, EagerCapture, capture_sizes
from framework.engine.engine import Engine
from framework.engine.request import Req, SamplingParams
from framework.engine.stats import engine_figures, instance_stats
from framework.model.config import ModelConfig
from framework.model.model import build_model
from plugins.moe.reference import ReferenceConfig as MoEConfig   # moe=reference
from framework.model.moe_stats import rank_expert_counts
from framework.contracts.parallel import Parallelism, ParallelConfig
from framework.runs.verify import logits_error
from graph_rank_fns import DP_PLAN, dp_decode

MODEL = ModelConfig()
SMALL = {"max_running_requests": 16, "cuda_graph_max_context": 256}   # buckets 1..16, a short captured width


def make_engine(capture: bool = True, **engine_kw) -> Engine:
    engine = Engine(MODEL, EngineConfig(**{**SMALL, **engine_kw}), Parallelism(ParallelConfig(), Group()),
                    MoEConfig(), seed=0)
    if capture:
        engine.graphs.capture(EagerCapture())
    return engine


def record_decisions(engine: Engine) -> list:
    """Each step's (batch rows, Decision), as the runner decided it."""
    seen, decide = [], engine.graphs.decide

    def recorded(batch):
        decision = decide(batch)
        seen.append((len(batch.reqs), decision))
        return decision
    engine.graphs.decide = recorded
    return seen


def serve(engine: Engine, plan: list[tuple[list[int], int]]) -> tuple[list[Req], dict[str, torch.Tensor]]:
    """Serve (prompt ids, max_new_tokens) requests to the end; every sampled token's logits row, by request."""
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logit_hook = lambda req, row: logits.setdefault(req.rid, []).append(row)
    reqs = [Req(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)) for prompt, n in plan]
    for r in reqs:
        engine.add(r)
    while engine.scheduler.has_work():
        engine.step()
    return reqs, {rid: torch.stack(rows) for rid, rows in logits.items()}


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 256 for j in range(n)]


@pytest.fixture(scope="module")
def reference():
    return build_model(MODEL, 0)


def test_buckets_are_sglangs_clipped_by_the_max_and_the_running_requests():
    assert capture_sizes(160, [], 256) == [1, 2, 4] + [8 * i for i in range(1, 21)]
    assert capture_sizes(96, [], 256)[-1] == 96
    assert capture_sizes(160, [], 20) == [1, 2, 4, 8, 16, 19, 20]   # v0.4.1: the pool's size and one less
    assert capture_sizes(256, [], 256)[-4:] == [232, 240, 248, 256]   # a raised max continues the multiples of 8
    assert capture_sizes(160, [5, 3, 500, 3], 256) == [3, 5]


def test_decisions_against_brute_force():
    """Bucket = the smallest captured size holding the rows (DP: the most rows of any rank); the eager reasons in
    their order: mode, disagree, size, off, context."""
    graphs = make_engine(cuda_graph_bs=[2, 5, 8], cuda_graph_max_context=30).graphs
    sizes = graphs.sizes
    for rows in range(12):
        for peer in (None, 0, 3, 7, 11):
            batch = ForwardBatch(ForwardMode.DECODE if rows else ForwardMode.IDLE, reqs=[None] * rows,
                                 seq_lens_cpu=[9] * rows, can_run_graph=True,
                                 global_num_tokens=None if peer is None else [rows, peer])
            most = rows if peer is None else max(rows, peer)
            if peer is None and not rows:
                continue                                    # one rank never runs an IDLE batch
            fits = [s for s in sizes if s >= most]
            got = graphs.decide(batch)
            assert (got.bucket, got.reason) == ((min(fits), None) if fits else (None, "size")), (rows, peer)
    decode = dict(reqs=[None] * 3, seq_lens_cpu=[9, 31, 4], can_run_graph=True)
    assert graphs.decide(ForwardBatch(ForwardMode.DECODE, **decode)).reason == "context"
    assert graphs.decide(ForwardBatch(ForwardMode.EXTEND, **decode)).reason == "mode"
    assert graphs.decide(ForwardBatch(ForwardMode.DECODE, **{**decode, "can_run_graph": False})).reason == "disagree"
    graphs.graphs.clear()
    off = graphs.decide(ForwardBatch(ForwardMode.DECODE, **decode))
    assert (off.bucket, off.reason) == (5, "off")                                     # still picks the bucket


def test_padded_replay_matches_eager_and_the_reference(reference):
    """6 then 4 then 2 requests decoding pad to buckets 8, 4, 2: the same tokens, logits within 1e-5 of the engine
    without graphs on the real rows, within 1e-4 of the reference, and the same expert counts (padding rows are not
    routed tokens)."""
    plan = [(prompt(5 + 9 * i, i), n) for i, n in enumerate([3, 3, 5, 5, 8, 8])]
    graph_engine, eager_engine = make_engine(), make_engine(capture=False, cuda_graph=False)
    decisions = record_decisions(graph_engine)
    graph_reqs, graph_logits = serve(graph_engine, plan)
    eager_reqs, eager_logits = serve(eager_engine, plan)
    assert {(rows, d.bucket) for rows, d in decisions if d.reason is None} == {(6, 8), (4, 4), (2, 2)}
    for g, e in zip(graph_reqs, eager_reqs):
        assert g.output_ids == e.output_ids
        assert (graph_logits[g.rid] - eager_logits[e.rid]).abs().max() < 1e-5
        assert logits_error(reference, g.prompt_ids, g.output_ids, graph_logits[g.rid]) < 1e-4
    assert rank_expert_counts(graph_engine.model) == rank_expert_counts(eager_engine.model)
    stats, sched = graph_engine.graphs.stats, graph_engine.scheduler.stats
    assert stats["graph_replayed_steps"] == sched["decode_steps"] > 0
    assert stats["graph_eager_steps"] == stats["graph_eager_mode_steps"] == sched["extend_steps"]


def test_too_large_batches_and_long_contexts_go_eager(reference):
    """Largest bucket 4 and a captured width of 40 slots: 6 decoding requests go eager (size), then 3 with a
    60-token prompt among them go eager on the padded batch (context), then 2 short ones replay."""
    plan = [(prompt(60, 0), 4), (prompt(8, 1), 4), (prompt(9, 2), 9), (prompt(10, 3), 9), (prompt(7, 4), 2),
            (prompt(6, 5), 2)]
    engine = make_engine(cuda_graph_max_bs=4, cuda_graph_max_context=40)
    decisions = record_decisions(engine)
    reqs, logits = serve(engine, plan)
    reasons = {(rows, d.reason) for rows, d in decisions}
    assert {(6, "size"), (4, "context"), (2, None)} <= reasons
    stats = engine.graphs.stats
    assert stats["graph_eager_size_steps"] and stats["graph_eager_context_steps"] and stats["graph_replayed_steps"]
    assert sum(stats[f"graph_eager_{r}_steps"] for r in ("mode", "disagree", "size", "off", "context")) \
        == stats["graph_eager_steps"]
    for r in reqs:
        assert logits_error(reference, r.prompt_ids, r.output_ids, logits[r.rid]) < 1e-4


def test_no_cuda_logs_one_line_and_counts_the_steps_off(caplog):
    """engine.cuda_graph=true on a CPU: one log line, decode eager (counted `off`), the keys in the run's figures;
    engine.cuda_graph=false: no line, the same counts."""
    for cuda_graph, lines in ((True, 1), (False, 0)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="framework.engine.engine"):
            engine = make_engine(capture=False, cuda_graph=cuda_graph)
        assert sum("no CUDA: CUDA graphs off" in r.getMessage() for r in caplog.records) == lines
        serve(engine, [(prompt(12, 0), 4), (prompt(20, 1), 4)])
        figures = engine_figures([{}], [instance_stats([engine.server_info()])])
        assert set(GRAPH_COUNTERS) <= set(figures)
        assert figures["graph_replayed_steps"] == 0
        assert figures["graph_eager_off_steps"] == engine.scheduler.stats["decode_steps"] > 0
        assert figures["graph_eager_steps"] == figures["steps"]


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="engine.cuda_graph_max_bs must be >= 1"):
        EngineConfig(cuda_graph_max_bs=0).validate()
    with pytest.raises(ValueError, match=r"engine.cuda_graph_bs must hold batch sizes >= 1.*\[4, 0\]"):
        EngineConfig(cuda_graph_bs=[4, 0]).validate()
    with pytest.raises(ValueError, match="engine.cuda_graph_max_context must be >= 1"):
        EngineConfig(cuda_graph_max_context=0).validate()


@pytest.mark.long
def test_dp_attention_ranks_agree_on_one_bucket(reference):
    """parallel=dp_attn on 2 gloo ranks, moe=triton_fused: uneven decode batches (3 and 9 rows) and an IDLE rank
    pad to the bucket of the larger count on both ranks (a disagreement would break the padded all-gathers); a rank
    whose context outgrows the captured width runs its padded batch eagerly while its peer replays; the largest
    bucket is v0.4.0's cap under DP attention (96, engine.cuda_graph_dp_attention_max_bs); every rank's logits match
    the reference."""
    ranks = launch(dp_decode, 2, DP_PLAN, backend="gloo", timeout_s=60)
    assert [r["sizes"][-1] for r in ranks] == [96, 96]
    steps = list(zip(*(r["decisions"] for r in ranks)))
    assert len(ranks[0]["decisions"]) == len(ranks[1]["decisions"])
    seen = set()
    for step in steps:
        counts = step[0][1]
        replay = [reason is None for _, _, _, reason in step]
        padded = [reason in (None, "context") for _, _, _, reason in step]
        assert len(set(padded)) == 1, step          # all ranks on the padded layout, or none
        if padded[0]:
            want = min(s for s in ranks[0]["sizes"] if s >= max(counts))
            assert [bucket for _, _, bucket, _ in step] == [want, want], step
            seen.add((tuple(counts), tuple(replay)))
    assert ((3, 9), (False, True)) in seen           # rank 0: its long context eagerly; rank 1 replays
    assert ((2, 9), (True, True)) in seen            # uneven counts, both replay bucket 16
    assert ((2, 0), (True, True)) in seen            # rank 1 IDLE replays padding only
    for rank in ranks:
        for prompt_ids, output_ids, logits in rank["outputs"]:
            assert logits_error(reference, prompt_ids, output_ids, logits) < 1e-4
