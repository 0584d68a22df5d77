"""Decode attention (one new token per sequence) over the paged cache, split-KV.

One program owns one (sequence, KV head, split): the ``GROUP`` query heads of that KV head
form the rows of one ``tl.dot`` tile, so each K/V tile is read once for the whole group.
A long context is cut into up to ``num_splits`` contiguous ranges computed on the device
from ``seq_lens``; each split writes its normalised partial output and log-sum-exp, and a
second kernel merges the splits. With one split the first kernel writes the output.

CUDA graphs: the kernels read only device tensors (``query_start_loc``, ``seq_lens``,
``block_tables``); the grid depends on the batch size, the KV head count and
``num_splits``, which ``choose_num_splits`` derives from shapes alone (the block table's
width, i.e. the longest context it can describe), never from host copies of lengths.
Rows whose query length is not 1 are skipped (prefill chunks of a mixed batch, empty
padding); a padded row with one token and ``seq_len`` 0 gets zeros, no NaN and no reads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2
from engine_core.kernels.paged_prefill import LOG2E, dot_precision
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

# A split below this many tokens costs more in the merge than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
# H200 sweep (32 q / 8 KV heads, d 128, bf16): one 32k-token sequence ran 0.14 ms with 16
# splits and 0.09 ms with 33 (the occupancy bound below); batches gained nothing from more.
MAX_SPLITS = 64
_ROW_MAX_START = tl.constexpr(-1.0e30)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_bt,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = q_row.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                mask=row_valid[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], _ROW_MAX_START, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        tile_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        # V is loaded beside K, before the QK^T dot (no measurable change at batch 1 on an
        # H200: a one-tile split stayed 7.7 us, latency-bound).
        v = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_rows = q_row.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_mask[None, :])
    else:
        # Partials are [num_seqs, Hq, NUM_SPLITS, (BLOCK_D)], contiguous, in float32.
        part = (seq.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out,
                 mask=row_valid[:, None])
        lse = tl.where(empty, -float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr,
                         stride_ot, stride_oh,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    part = (seq.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=-float("inf"))
    used = lse > -float("inf")  # empty splits never wrote their partial output
    # A finite floor keeps an all-empty row (seq_len 0) free of -inf - -inf.
    weight = tl.exp2(lse - tl.maximum(tl.max(lse, 0), _ROW_MAX_START))
    partial = tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :],
                      mask=used[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int,
                      block_size: int, device: torch.device) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe).

    Enough (sequence, head, split) programs to fill the GPU about twice, but never a
    split shorter than ``MIN_TOKENS_PER_SPLIT`` of the longest context the block table
    can hold, and at most ``MAX_SPLITS``.
    """
    max_tokens = max_blocks_per_seq * block_size
    by_length = triton.cdiv(max_tokens, MIN_TOKENS_PER_SPLIT)
    num_sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    by_occupancy = triton.cdiv(2 * num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           out: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None) -> None:
    """Fill the rows of ``out`` ``[T, Hq, D]`` of the sequences with exactly one new token.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` and already hold the
    new token. ``num_splits=None`` picks ``choose_num_splits``.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1],
                                       block_size, q.device)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    block_d = next_power_of_2(head_dim)
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 or block_d > 128 else 64
    extra = {} if num_stages is None else {"num_stages": num_stages}
    pdl = pdl_args(q.device)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, block_d,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens,
        query_start_loc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps,
        **extra, **pdl)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, query_start_loc, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits), num_warps=2, **pdl)
