"""EPLB's weight moves in mode=sim (issue 21, item 1; plugins/cost/lib/eplb_moves.py): the pass SGLang's EPLBManager
rebalances at stalls by the moves' time, and the counters are the real path's (plugins/moe/ep.py: one move per
(rank, expert) newly held, of 3 x hidden x moe_intermediate weights, summed over the MoE layers)."""
from __future__ import annotations

import random
from functools import lru_cache

import pytest

from framework.config import compose
from framework.contracts.cost import InstanceShape
from framework.core.registry import COST
from framework.engine.request import Req, SamplingParams
from framework.runs.sim import cost_model, simulate
from framework.sim.instance import SimInstance
from plugins.cost.lib.eplb_moves import layer_seconds, rank_work, schedule, transfers
from plugins.moe.lib.placement import Placement

EVERY = 4


@lru_cache(maxsize=None)
def config():
    """The toy MoE (8 experts, 3 MoE layers) on 2 H100s under moe=ep with 2 redundant slots, rebalanced every 4
    passes for Zipf loads; composed once (composing is the slow part)."""
    return compose(["mode=sim", "logger.mode=disabled", "sim/cost=roofline", "parallel=tp", "parallel.size=2",
                    "moe=ep", "moe.num_redundant_experts=2", f"moe.eplb.rebalance_every={EVERY}",
                    "sim.cost.expert_loads=zipf", "workload=multi_turn", "workload.num_conversations=3",
                    "workload.turns=2", "cluster.instances=1"])


def sglang_manager(every: int, chunks: int, passes: int) -> dict[int, int]:
    """SGLang's EPLBManager._entrypoint as written (eplb_manager.py at 53e29da), driven by on_forward_pass_end after
    each pass: pass -> the chunk of layers it moves."""
    moved: dict[int, int] = {}
    current = [0]

    def rebalance():
        for c in range(chunks):
            if chunks > 1:
                yield
            moved[current[0]] = c

    def entrypoint():
        while True:
            for _ in range(every):
                yield
            yield from rebalance()
    gen = entrypoint()
    for n in range(1, passes + 1):
        current[0] = n
        next(gen)
    return moved


@pytest.mark.parametrize("every,chunks", [(1, 1), (4, 1), (3, 2), (5, 3)])
def test_the_schedule_is_sglangs_eplb_manager(every, chunks):
    want = sglang_manager(every, chunks, 60)
    got = {n: when[1] for n in range(1, 61) if (when := schedule(n, every, chunks)) is not None}
    assert got == want and len(got) > chunks


def test_moves_are_the_real_paths_with_sglangs_sources():
    rng = random.Random(0)
    for _ in range(20):        # which (expert, rank) pairs move: the real path's Placement.moves
        old, new = [list(range(8)) + [rng.randrange(8) for _ in range(4)] for _ in range(2)]
        rng.shuffle(old)
        rng.shuffle(new)
        real = Placement(tuple(old), 8, 4).moves(Placement(tuple(new), 8, 4))
        assert sorted((e, d) for e, _, d in transfers(old, new, 4, 2)) == sorted((e, d) for e, _, d in real)
    # 4 ranks of one slot each, 2 per node: a node's own holder first, else the holders split the receivers
    assert transfers([0, 1, 2, 3], [1, 0, 3, 2], 4, 2) == [(0, 0, 1), (1, 1, 0), (2, 2, 3), (3, 3, 2)]
    assert transfers([0, 0, 1, 2], [1, 2, 0, 0], 4, 2) == [(0, 0, 2), (0, 1, 3), (1, 2, 0), (2, 3, 1)]


def test_a_layer_waits_for_its_slowest_rank_on_its_slower_link():
    # rank 0 (node 0) sends expert 0 to rank 1 (node 0) and expert 0 to ranks 2, 3 (node 1, no holder there)
    old, new = [0, 1, 2, 3], [0, 0, 0, 0]
    work = rank_work(old, new, 4, 2, transfers(old, new, 4, 2))
    links = {True: (100.0, 1.0), False: (10.0, 2.0)}
    rank0 = max(1.0 + 1 * 50 / 100.0, 2.0 + 2 * 50 / 10.0)      # two experts over the NIC, one over NVLink
    assert layer_seconds(work, 50, links, lambda nbytes: nbytes / 1000) == pytest.approx(rank0)
    # a rank that already holds the expert in another slot: copied to the buffer before the wait and back after
    work = rank_work([0, 1], [1, 0], 1, 1, [])
    assert layer_seconds(work, 50, links, lambda nbytes: nbytes / 1000) == pytest.approx(2 * (2 * 2 * 50 / 1000))


def expected_first_rebalance(cost) -> tuple[int, float]:
    """(experts moved, seconds) of the first rebalance, from the real path's moves and the cost model's links: two
    ranks in one node, so every move is on NVLink; each rank's slots that change expert are copied in."""
    moves, seconds = 0, 0.0
    bandwidth, latency = cost.kv_link(True)
    nbytes = cost.eplb_moves.expert_bytes
    for new in cost.eplb_moves.placed:
        old = cost.eplb_moves.initial
        real = Placement(old, 8, 2).moves(Placement(tuple(new), 8, 2))
        moves += len(real)
        per_rank = []
        for r in (0, 1):
            slots = range(5 * r, 5 * r + 5)
            held = {old[s] for s in slots}
            changed = [s for s in slots if old[s] != new[s]]
            wire = max(sum(src == r for _, src, _ in real), sum(dst == r for _, _, dst in real))
            per_rank.append(cost.rf.memop("add", 2 * nbytes * sum(new[s] in held for s in changed))
                            + (latency + wire * nbytes / bandwidth if wire else 0.0)
                            + cost.rf.memop("add", 2 * nbytes * len(changed)))
        seconds += max(per_rank)
    return moves, seconds


def test_the_rebalancing_pass_stalls_by_its_moves_and_counts_them():
    cfg = config()
    cost = cost_model(cfg)
    m = cfg.model
    moved, stall = expected_first_rebalance(cost)
    assert moved > 0 and stall > 0
    priced: list[float] = []
    step_time = cost.step_time
    cost.step_time = lambda step: priced.append(step_time(step)) or priced[-1]    # what each step costs without it
    for fast in (False, True):         # pass 5 stepped alone, or inside a run of decode steps
        inst, now = SimInstance("sim://0", cfg, cost), 0.0
        for i in range(2):
            inst.add(Req(list(range(3 + i, 40)), SamplingParams(max_new_tokens=30, ignore_eos=True)))
        while inst.forward_passes < EVERY + 3:
            if fast and inst.forward_passes == EVERY:
                assert inst.run_ahead() >= 2
                graph = all(d.reason is None for d in inst.step.run_decisions())
                plain = cost.decode_times(*zip(*[(len(g.running), sum(r.kv_len for r in g.running))
                                                 for g in inst.groups]), 2, graph=graph)
                times = inst.run_times(2)
                assert times == pytest.approx([plain[0] + stall, plain[1]], rel=1e-12, abs=0)
                now += sum(times)
                inst.advance(2, times, now)
                continue
            d = inst.start_step()
            now += d
            inst.finish_step(now)
            assert d == pytest.approx(priced[-1] + (stall if inst.forward_passes == EVERY + 1 else 0.0), rel=1e-12)
        counters = {k: v for k, v in inst.stats().items() if k.startswith("eplb_")}
        layers = m.num_layers - m.first_k_dense_replace
        assert counters == {"eplb_rebalances": layers, "eplb_experts_moved": moved, "eplb_stall_s": stall,
                            "eplb_bytes_moved": moved * 3 * m.hidden_size * m.moe_intermediate_size * m.linear_itemsize}


def test_sim_results_report_the_real_paths_keys():
    cfg = config()
    res, _ = simulate(cfg)
    m = cfg.model
    rebalances = sum(schedule(n, EVERY) is not None for n in range(1, res["steps"] + 1))
    assert res["eplb_rebalances"] == rebalances * (m.num_layers - m.first_k_dense_replace) > 0
    assert (res["eplb_experts_moved"], res["eplb_stall_s"]) == pytest.approx(expected_first_rebalance(cost_model(cfg)))
    # a backend that places no experts: nothing to price, no keys (as the real path's figures)
    blocks = COST.build("roofline", cfg.sim.cost, InstanceShape(cfg.model, cfg.hardware, "tp", 2, "triton_fused"))
    inst = SimInstance("sim://0", cfg, blocks)
    inst.add(Req(list(range(3, 20)), SamplingParams(max_new_tokens=EVERY + 2, ignore_eos=True)))
    while inst.start_step() is not None:
        inst.finish_step(0.0)
    assert inst.forward_passes > EVERY and not [k for k in inst.stats() if k.startswith("eplb_")]


def test_chunks_spread_the_same_moves_over_the_next_passes():
    moves = cost_model(config()).eplb_moves
    whole = [moves.at(n) for n in range(1, 3 * EVERY + 3)]
    moves.chunks = [range(0, 2), range(2, 3)]                 # sim.cost.eplb_layers_per_chunk=2 of the 3 layers
    chunked = [moves.at(n) for n in range(1, 3 * EVERY + 3)]
    assert [n for n, m in enumerate(whole, 1) if m["eplb_rebalances"]] == [EVERY + 1, 2 * EVERY + 1, 3 * EVERY + 1]
    assert [(n, m["eplb_rebalances"]) for n, m in enumerate(chunked, 1) if m["eplb_rebalances"]] == \
        [(EVERY + 2, 2), (EVERY + 3, 1), (2 * EVERY + 4, 2), (2 * EVERY + 5, 1)]
    for key in ("eplb_experts_moved", "eplb_stall_s"):
        total = sum(m[key] for m in whole)
        assert total > 0 and sum(m[key] for m in chunked) == pytest.approx(total)
