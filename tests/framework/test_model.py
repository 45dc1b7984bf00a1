import dataclasses

import pytest
import torch

from framework.contracts.batch import ForwardBatch, ForwardMode
from framework.engine.kv_pool import KVPool, ReqToTokenPool
from framework.model.config import ModelConfig
from framework.model.gating import select_experts
from framework.model.model import build_model
from framework.model.reference import reference_forward
from framework.model.tokenizer import ByteTokenizer
from framework.contracts.parallel import Parallelism, ParallelConfig
from framework.dist.group import Group


def test_kv_bytes_per_token_is_latent_plus_rope_key_only():
    cfg = ModelConfig()
    assert cfg.kv_cache_width == cfg.kv_lora_rank + cfg.qk_rope_head_dim == 80
    assert cfg.kv_bytes_per_token() == cfg.num_layers * 80 * 4
    # independent of the head count: that is what makes TP waste memory on MLA
    assert dataclasses.replace(cfg, num_heads=32).kv_bytes_per_token() == cfg.kv_bytes_per_token()
    assert dataclasses.replace(cfg, dtype="bfloat16").kv_bytes_per_token() == cfg.num_layers * 80 * 2


def test_shapes_and_layers():
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    assert len(model.moe_layers()) == cfg.num_layers - cfg.first_k_dense_replace
    moe = model.moe_layers()[0]
    assert moe.w13.shape == (8, 128, 128) and moe.w2.shape == (8, 128, 64)
    logits = reference_forward(model, list(range(10)))
    assert logits.shape == (10, cfg.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = (build_model(ModelConfig(), s) for s in (0, 0, 1))
    assert torch.equal(a.embed, b.embed) and not torch.equal(a.embed, c.embed)


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_normal_absorbed_extend_and_decode_match_reference(q_lora_rank):
    """Prefill 8 tokens (no prefix: decompressed), extend 4 more on that prefix (absorbed), decode 1 (absorbed),
    each reading its slots through a req_to_token row: equal to the plain forward."""
    cfg = dataclasses.replace(ModelConfig(), q_lora_rank=q_lora_rank)
    model = build_model(cfg, seed=3)
    for layer in model.moe_layers():
        from plugins.moe.reference import ReferenceMoE
        layer.backend = ReferenceMoE(None, layer.w13, layer.w2, Group())
    par = Parallelism(ParallelConfig(), Group())
    pool = KVPool(cfg.num_layers, cfg.kv_cache_width, 64, torch.float32)
    rows = ReqToTokenPool(2, 32)
    row = rows.alloc()
    ids = list(range(40, 53))
    slots = pool.alloc(13)
    rows.write(row, 0, slots)

    def batch(mode, start, end, **kw):
        return ForwardBatch(mode, input_ids=torch.tensor(ids[start:end]), positions=torch.arange(start, end),
                            out_cache_loc=slots[start:end], req_to_token=rows.table, req_pool_indices_cpu=[row],
                            seq_lens_cpu=[end], prefix_lens=[start], extend_lens=[end - start], **kw).to("cpu")
    got_prefill = model(batch(ForwardMode.EXTEND, 0, 8, return_all_logits=True), pool, par)
    got_extend = model(batch(ForwardMode.EXTEND, 8, 12, return_all_logits=True), pool, par)
    got_decode = model(batch(ForwardMode.DECODE, 12, 13), pool, par)
    expect = reference_forward(model, ids)
    assert (got_prefill - expect[:8]).abs().max() < 1e-4
    assert (got_extend - expect[8:12]).abs().max() < 1e-4
    assert (got_decode[0] - expect[12]).abs().max() < 1e-4


def test_gating_v2_grouped_topk_by_hand():
    # 4 experts in 2 groups; token prefers expert 0 overall but group 1 holds the 2nd and 3rd best
    logits = torch.tensor([[3.0, -5.0, 2.5, 2.4]])
    ids, w = select_experts(logits, top_k=2, n_group=2, topk_group=1, gating="v2", routed_scaling_factor=2.0,
                            norm_topk_prob=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[0, 1]]            # group 0 (max 3.0) beats group 1 (max 2.5): only its experts
    assert torch.allclose(w, probs[:, [0, 1]] * 2.0)


def test_gating_v3_bias_steers_selection_not_weights():
    logits = torch.tensor([[1.0, 0.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0])
    ids, w = select_experts(logits, top_k=1, n_group=1, topk_group=1, gating="v3", routed_scaling_factor=1.0,
                            norm_topk_prob=False, correction_bias=bias)
    assert ids.tolist() == [[1]] and torch.allclose(w, torch.sigmoid(torch.tensor([[0.0]])))
    ids, w = select_experts(logits, top_k=2, n_group=1, topk_group=1, gating="v3", routed_scaling_factor=1.0,
                            norm_topk_prob=True, correction_bias=bias)
    assert torch.allclose(w.sum(-1), torch.ones(1))


def test_model_config_validation_is_one_sentence():
    with pytest.raises(ValueError, match="not divisible by n_group=3"):
        dataclasses.replace(ModelConfig(), n_group=3).validate()


def test_tokenizer_roundtrip_and_bad_bytes():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.encode("a", add_bos=True) == [tok.BOS, 97]
    with pytest.raises(ValueError, match="not valid UTF-8"):
        tok.encode(b"ok\xff\xfe")
