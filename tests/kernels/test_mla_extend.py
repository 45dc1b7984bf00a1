"""The absorbed MLA extend kernel (interpreted on CPU, compiled on CUDA) against its torch twin, and the twin
against torch's scaled_dot_product_attention."""

import torch
import torch.nn.functional as F

from kernels.mla_extend import mla_extend_torch, mla_extend_traffic, mla_extend_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the real-width case: bf16 on a GPU, with the launch settings the GPU check times; fp32 under the interpreter (its
# bf16 dot is wrong)
WIDE_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_extend(prefixes, extends, heads, v_dim, rope_dim, dtype, seed=0):
    """Random queries and new rows for each request's new tokens, and a cache holding its prefix rows (scattered)."""
    gen = torch.Generator().manual_seed(seed)
    B, width, max_prefix = len(prefixes), v_dim + rope_dim, max(prefixes) + 2
    rows = B * max_prefix + 5
    T = sum(extends)
    to = dict(device=DEVICE)
    tensors = (torch.randn(T, heads, width, generator=gen), torch.randn(T, width, generator=gen),
               torch.randn(rows, width, generator=gen))
    table = torch.randperm(rows, generator=gen)[:B * max_prefix].view(B, max_prefix).to(torch.int32)
    lens = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (prefixes, extends))
    return (*(t.to(dtype=dtype, **to) for t in tensors), table.to(**to), *lens)


def assert_matches_twin(q, new, kv, table, prefix_lens, extend_lens, v_dim, **launch):
    scale = q.shape[-1] ** -0.5
    got = mla_extend_triton(q, new, kv, table, prefix_lens, extend_lens, scale, v_dim=v_dim, **launch)
    expected = mla_extend_torch(q, new, kv, table, prefix_lens, extend_lens, scale, v_dim=v_dim)
    assert got.shape == (q.shape[0], q.shape[1], v_dim) and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[q.dtype], rtol=0)


def test_prefixes_and_partial_query_blocks():
    """No prefix, a short one, one longer than a row block; new tokens filling 1 and 2 query blocks, partially."""
    inputs = make_extend([0, 5, 33], [7, 20, 3], heads=3, v_dim=32, rope_dim=16, dtype=torch.float32)
    assert_matches_twin(*inputs, 32, block_m=16, block_n=16)


def test_row_blocks_wider_than_query_blocks():
    """BLOCK_N > BLOCK_M (the GPU's 64 over 32): a query block's last row block runs past its causal end."""
    inputs = make_extend([10, 0], [40, 17], heads=2, v_dim=64, rope_dim=16, dtype=torch.float16, seed=1)
    assert_matches_twin(*inputs, 64, block_m=16, block_n=32)


def test_deepseek_latent_width():
    """DeepSeek's 512 + 64 latent with the launch settings the GPU check measures (32-token query blocks, 64 rows)."""
    inputs = make_extend([3], [40], heads=2, v_dim=512, rope_dim=64, dtype=WIDE_DTYPE, seed=2)
    assert_matches_twin(*inputs, 512)


def test_twin_is_causal_attention_after_the_prefix():
    q, new, kv, table, prefix_lens, extend_lens = make_extend([0, 6], [5, 4], heads=3, v_dim=8, rope_dim=4,
                                                              dtype=torch.float32, seed=3)
    got = mla_extend_torch(q, new, kv, table, prefix_lens, extend_lens, 0.3, v_dim=8)
    first = 0
    for b, (p, n) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        rows = torch.cat([kv[table[b, :p].long()], new[first:first + n]])
        visible = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
        expected = F.scaled_dot_product_attention(q[first:first + n].transpose(0, 1), rows[None], rows[None, :, :8],
                                                  attn_mask=visible, scale=0.3)
        torch.testing.assert_close(got[first:first + n], expected.transpose(0, 1), atol=1e-6, rtol=1e-5)
        first += n


def test_traffic_of_a_prompt_without_prefix():
    t = mla_extend_traffic(2, 16, 512)
    pairs = 512 * 513 / 2
    assert t["flops"] == 2 * 2 * 16 * pairs * (576 + 512)
    assert t["once_bytes"] < t["bytes"] < 16 * t["once_bytes"]   # heads re-read the rows; causal halves them
