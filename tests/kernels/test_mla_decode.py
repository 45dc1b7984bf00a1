"""The two-stage grouped MLA decode kernel (interpreted on CPU, compiled on CUDA) against its torch twin, and the
twin against torch's own scaled_dot_product_attention."""

import torch
import torch.nn.functional as F

from kernels.mla_decode import contiguous_page_table, mla_decode_torch, mla_decode_traffic, mla_decode_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the real-width case: bf16 on a GPU, with the launch settings the GPU check times; fp32 under the interpreter (its
# bf16 dot is wrong)
WIDE_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# fp16/bf16: the kernel rounds the softmax weights to the input dtype before the value product
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_decode(lens, heads, v_dim, rope_dim, dtype, seed=0, paged=True):
    """Random q and a latent cache holding each request's rows (scattered through the cache when ``paged``)."""
    gen = torch.Generator().manual_seed(seed)
    B, width, max_len = len(lens), v_dim + rope_dim, max(lens) + 3
    rows = B * max_len + 11
    kv = torch.randn(rows, width, generator=gen)
    table = (torch.randperm(rows, generator=gen)[:B * max_len].view(B, max_len) if paged
             else contiguous_page_table(B, max_len))
    q = torch.randn(B, heads, width, generator=gen)
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), table.to(torch.int32).to(**to),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


def assert_matches_twin(q, kv, table, lens, v_dim, **launch):
    scale = q.shape[-1] ** -0.5
    got = mla_decode_triton(q, kv, table, lens, scale, v_dim=v_dim, **launch)
    expected = mla_decode_torch(q, kv, table, lens, scale, v_dim=v_dim)
    assert got.shape == (q.shape[0], q.shape[1], v_dim) and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[q.dtype], rtol=0)


def test_paged_cache_with_empty_and_uneven_splits():
    """Contexts of 1 (seven of eight splits empty), 8, 9 (per split 2: three splits empty) and 70 tokens, fewer
    heads than one block: every split and head mask in play."""
    q, kv, table, lens = make_decode([1, 8, 9, 70], heads=5, v_dim=32, rope_dim=16, dtype=torch.float32)
    assert_matches_twin(q, kv, table, lens, 32)


def test_two_head_blocks_contiguous_cache():
    """20 heads: one full block of 16 and a partial one; a [S, 1, D] cache laid out request after request; three
    splits, rows 16 at a time."""
    q, kv, table, lens = make_decode([33, 64], heads=20, v_dim=64, rope_dim=16, dtype=torch.float16, seed=1, paged=False)
    assert_matches_twin(q, kv.unsqueeze(1), table, lens, 64, num_kv_splits=3, block_n=16)


def test_deepseek_latent_width():
    """DeepSeek-V2/V3's 512 + 64 latent with the launch settings the GPU check measures."""
    q, kv, table, lens = make_decode([40], heads=16, v_dim=512, rope_dim=64, dtype=WIDE_DTYPE, seed=2)
    assert_matches_twin(q, kv, table, lens, 512)


def test_twin_is_attention():
    """The twin is plain attention: torch's SDPA per request, keys the rows, values their first v_dim columns."""
    q, kv, table, lens = make_decode([5, 12], heads=3, v_dim=8, rope_dim=4, dtype=torch.float32, seed=3)
    got = mla_decode_torch(q, kv, table, lens, 0.3, v_dim=8)
    for b, n in enumerate(lens.tolist()):
        rows = kv[table[b, :n].long()]
        expected = F.scaled_dot_product_attention(q[b][:, None], rows[None], rows[None, :, :8], scale=0.3)
        torch.testing.assert_close(got[b], expected[:, 0], atol=1e-6, rtol=1e-5)


def test_traffic_counts_a_row_once_per_head_block():
    one, eight = (mla_decode_traffic(4, h, 100) for h in (16, 128))
    assert one["head_blocks"] == 1 and eight["head_blocks"] == 8
    assert one["latent_once_bytes"] == eight["latent_once_bytes"] == 4 * 100 * 576 * 2
    assert eight["flops"] == 8 * one["flops"] == 2 * 4 * 128 * 100 * (576 + 512)
    assert eight["stage1_bytes"] > 8 * one["latent_once_bytes"]
