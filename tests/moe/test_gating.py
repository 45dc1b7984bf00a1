"""select_experts (DeepSeek V2 and V3 gating) against a brute force that enumerates every choice of groups and of
experts, in float64 Python: tiny shapes, random logits (no ties)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from framework.model.gating import select_experts


def brute_force(logits: list[float], *, top_k, n_group, topk_group, gating, bias, scale, renorm):
    """(sorted expert ids, their weights) for one token, by exhaustive search."""
    num_experts = len(logits)
    if gating == "v2":
        top = max(logits)
        exp = [math.exp(v - top) for v in logits]
        scores = [v / sum(exp) for v in exp]
        choice = scores
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + b for s, b in zip(scores, bias)]
    per_group = num_experts // n_group
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(n_group)]

    def group_score(g):
        vals = sorted((choice[e] for e in groups[g]), reverse=True)
        return vals[0] if gating == "v2" else vals[0] + vals[1]

    best_groups = max(itertools.combinations(range(n_group), topk_group),
                      key=lambda gs: sum(group_score(g) for g in gs))
    allowed = [e for g in best_groups for e in groups[g]]
    ids = sorted(max(itertools.combinations(allowed, top_k), key=lambda es: sum(choice[e] for e in es)))
    weights = [scores[e] for e in ids]
    if renorm:
        weights = [w / sum(weights) for w in weights]
    return ids, [w * scale for w in weights]


CASES = [  # (num_experts, top_k, n_group, topk_group)
    (8, 3, 4, 2),
    (6, 2, 3, 1),
    (8, 2, 1, 1),   # no grouping
    (12, 4, 4, 3),
]


@pytest.mark.parametrize("gating", ["v2", "v3"])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("num_experts, top_k, n_group, topk_group", CASES)
def test_select_experts_matches_brute_force(gating, renorm, num_experts, top_k, n_group, topk_group):
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k * 10 + n_group + renorm)
    logits = torch.randn(24, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.5
    scale = 2.5
    ids, weights = select_experts(logits, top_k=top_k, n_group=n_group, topk_group=topk_group, gating=gating,
                                  routed_scaling_factor=scale, norm_topk_prob=renorm,
                                  correction_bias=bias if gating == "v3" else None)
    assert ids.shape == weights.shape == (24, top_k) and ids.dtype == torch.int64
    assert weights.dtype == torch.float32
    order = ids.argsort(dim=1)
    ids, weights = ids.gather(1, order), weights.gather(1, order)
    for t in range(logits.shape[0]):
        want_ids, want_weights = brute_force(logits[t].tolist(), top_k=top_k, n_group=n_group,
                                             topk_group=topk_group, gating=gating, bias=bias.tolist(),
                                             scale=scale, renorm=renorm)
        assert ids[t].tolist() == want_ids, (t, logits[t])
        assert weights[t].tolist() == pytest.approx(want_weights, abs=1e-6)
        if renorm:
            assert sum(want_weights) == pytest.approx(scale)


def test_v3_bias_steers_selection_but_not_weights():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 8, generator=gen)
    kw = dict(top_k=2, n_group=4, topk_group=2, gating="v3", routed_scaling_factor=1.0, norm_topk_prob=False)
    plain_ids, _ = select_experts(logits, **kw)
    bias = torch.zeros(8)
    bias[5] = 100.0
    ids, weights = select_experts(logits, correction_bias=bias, **kw)
    assert (ids == 5).any(dim=1).all()                         # the bias wins every token a slot on expert 5 ...
    assert not (plain_ids == 5).any(dim=1).all()               # ... which it did not have without it
    slot = (ids == 5).int().argmax(dim=1)
    torch.testing.assert_close(weights.gather(1, slot[:, None]).squeeze(1), logits[:, 5].sigmoid())  # unbiased


def test_v2_groups_are_ranked_by_their_best_expert_and_v3_by_their_top_two():
    # Group 0 = experts {0,1}: one strong expert. Group 1 = {2,3}: two good ones. One group allowed.
    logits = torch.tensor([[3.0, -4.0, 2.0, 2.0]])
    kw = dict(top_k=1, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    v2_ids, _ = select_experts(logits, gating="v2", **kw)
    v3_ids, _ = select_experts(logits, gating="v3", correction_bias=torch.zeros(4), **kw)
    assert v2_ids.item() == 0        # max: 3.0 beats 2.0
    assert v3_ids.item() in (2, 3)   # top-2 sum: sigmoid(2)*2 = 1.76 beats sigmoid(3) + sigmoid(-4) = 0.97


def test_routed_scaling_factor_scales_the_weights_only():
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    kw = dict(top_k=2, n_group=4, topk_group=2, gating="v2", norm_topk_prob=False)
    ids1, w1 = select_experts(logits, routed_scaling_factor=1.0, **kw)
    ids16, w16 = select_experts(logits, routed_scaling_factor=16.0, **kw)
    assert torch.equal(ids1, ids16)
    torch.testing.assert_close(w16, 16.0 * w1)
    assert (w1.sum(dim=1) < 1.0).all()   # v2 without renormalisation: a part of the softmax mass


def test_unknown_gating_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown gating 'v4'; known: v2, v3"):
        select_experts(torch.zeros(1, 4), top_k=1, n_group=1, topk_group=1, gating="v4",
                       routed_scaling_factor=1.0, norm_topk_prob=False)


def test_one_group_of_two_keeps_every_token_on_one_half_of_the_experts():
    """n_group=2, topk_group=1 (tests/moe/test_moe_verify.py): a token's experts lie in one half, i.e. on one
    ep rank at size 2."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    ids, _ = select_experts(logits, top_k=3, n_group=2, topk_group=1, gating="v3", routed_scaling_factor=1.0,
                            norm_topk_prob=True, correction_bias=torch.zeros(8))
    half = ids // 4
    assert (half == half[:, :1]).all() and 0 < half[:, 0].sum() < 64   # both halves get tokens
