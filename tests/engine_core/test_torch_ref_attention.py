"""The torch reference paged attention against dense causal attention computed directly."""

from __future__ import annotations

import pytest
import torch

from engine_core.attention.backend import get_attention_backend
from engine_core.attention.torch_ref import write_to_paged_cache

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 40


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [Lq,Hq,D] at the last Lq of k/v [Lk,Hkv,D]; explicit float64 softmax."""
    q_len, k_len = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_block_tables(seq_lens: list[int], generator: torch.Generator) -> list[list[int]]:
    """Disjoint, shuffled blocks per sequence so reads must follow the table."""
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // BLOCK_SIZE)
        tables.append(order[:count])
        order = order[count:]
    return tables


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_two_steps_match_dense(cache_dtype: torch.dtype, make_metadata) -> None:
    generator = torch.Generator().manual_seed(0)
    final_lens = [13, 1, 9, 17, 4]     # odd lengths crossing block boundaries
    first_lens = [7, 0, 8, 12, 1]      # step 1 prefills these (0: sequence joins at step 2)
    tables = random_block_tables(final_lens, generator)
    total = sum(final_lens)
    q = torch.randn(total, NUM_Q_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    seq_offsets = [sum(final_lens[:i]) for i in range(len(final_lens))]
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    backend = get_attention_backend("cpu", cache_dtype)
    scale = HEAD_DIM ** -0.5

    def rows(start: list[int], count: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(o + s, o + s + n)
                          for o, s, n in zip(seq_offsets, start, count)])

    step_inputs = [([0] * len(final_lens), first_lens),
                   (first_lens, [f - s for f, s in zip(final_lens, first_lens)])]
    for cached, new in step_inputs:
        metadata = make_metadata(new, cached, tables, BLOCK_SIZE)
        idx = rows(cached, new)
        out = backend.forward(q[idx], k[idx], v[idx], kv_cache, metadata, scale)
        # The reference sees K/V exactly as the cache stores them.
        k_ref = k.to(cache_dtype).to(torch.float32)
        v_ref = v.to(cache_dtype).to(torch.float32)
        expected = []
        for o, c, n in zip(seq_offsets, cached, new):
            if n:
                expected.append(dense_attention(q[o + c:o + c + n], k_ref[o:o + c + n],
                                                v_ref[o:o + c + n], scale))
        torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_write_casts_into_slots() -> None:
    kv_cache = torch.zeros(2, 3, 4, 1, 2, dtype=torch.float8_e4m3fn)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    write_to_paged_cache(k, -k, kv_cache, torch.tensor([5, 11]))
    flat = kv_cache.view(2, 12, 1, 2).float()
    assert flat[0, 5].tolist() == [[1.0, 2.0]] and flat[0, 11].tolist() == [[3.0, 4.0]]
    assert flat[1, 11].tolist() == [[-3.0, -4.0]]
    assert flat[0].abs().sum() == 10.0


def test_no_cache_prefill_matches_dense(make_metadata) -> None:
    generator = torch.Generator().manual_seed(1)
    lens = [5, 3]
    q = torch.randn(8, NUM_Q_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(8, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(8, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    metadata = make_metadata(lens, [0, 0], [[0, 1], [2]], BLOCK_SIZE)
    out = get_attention_backend("cpu", "auto").forward(q, k, v, None, metadata, 0.25)
    expected = torch.cat([dense_attention(q[:5], k[:5], v[:5], 0.25),
                          dense_attention(q[5:], k[5:], v[5:], 0.25)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
