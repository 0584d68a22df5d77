"""Causal attention of a varlen batch of prefill chunks over the paged cache.

Sequence i's new tokens ``query_start_loc[i]:query_start_loc[i+1]`` sit at the last
positions of its ``seq_lens[i]`` tokens; each attends to the cached prefix plus the new
tokens up to itself. K/V are read through the block table, so the same kernel serves a
first prefill, a chunk after a cached prefix, and a prefix-cache hit.

One program owns ``BLOCK_Q`` tokens of one sequence for one KV head, with all ``GROUP``
query heads of that KV head stacked into the tile's rows (row r = token r // GROUP, head
r % GROUP): every K/V tile is loaded once for the whole group. The KV loop runs in two
phases: tiles every row of the program may fully see (no mask), then the diagonal tiles
(causal and length mask).

The grid is a list of query tiles, ``(sequence, first token)`` pairs built on the host
(``attention/prefill_tiles.py``) and read by each program, so no program is launched for a tile
that holds no token. A CUDA graph of a mixed step is captured over the most tiles a step of
its size can have (``max_prefill_tiles``); a step with fewer marks the rest ``-1`` and
their programs exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2

LOG2E = 1.4426950408889634
# Start of each row's running max: finite, so a row whose keys are all masked (-inf) so far
# gets exp2(-inf - _ROW_MAX_START) = 0 instead of NaN.
_ROW_MAX_START = tl.constexpr(-1.0e30)


@triton.jit
def _kv_tile_offsets(block_tables_ptr, seq, stride_bt, q_start, pos, kv_head, valid,
                     stride_kb, stride_ks, stride_kh, stride_kt,
                     BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Element offsets of the K/V rows at absolute positions ``pos`` of one sequence."""
    if PAGED:
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid,
                        other=0).to(tl.int64)
        rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    else:
        rows = (q_start + pos).to(tl.int64) * stride_kt + kv_head * stride_kh
    return rows


@triton.jit
def _attend_tiles(q, acc, m_i, l_i, k_ptr, v_ptr, block_tables_ptr, seq, stride_bt, q_start,
                  kv_head, lo, hi, seq_len, q_pos, scale_log2,
                  stride_kb, stride_ks, stride_kh, stride_kt,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, m_i, l_i) with the keys in ``[lo, hi)``."""
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_seq = pos < seq_len
        rows = _kv_tile_offsets(block_tables_ptr, seq, stride_bt, q_start, pos, kv_head, in_seq,
                                stride_kb, stride_ks, stride_kh, stride_kt, BLOCK_SIZE, PAGED)
        tile_mask = in_seq[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, tiles_ptr, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_kt, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    seq = tl.load(tiles_ptr + 2 * tl.program_id(0))
    if seq < 0:  # past this step's tiles (a graph's grid covers the most a step can have)
        return
    tile_start = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = q_len
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_mask[None, :], other=0.0)
    q_pos = ctx_len + tok

    m_i = tl.full([BLOCK_M], _ROW_MAX_START, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys at or before the tile's first position are visible to every row: no mask.
    full_end = ((ctx_len + tile_start + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, ctx_len + tile_start + BLOCK_Q)
    acc, m_i, l_i = _attend_tiles(q, acc, m_i, l_i, k_ptr, v_ptr, block_tables_ptr, seq,
                                  stride_bt, q_start, kv_head, 0, full_end, seq_len, q_pos,
                                  scale_log2, stride_kb, stride_ks, stride_kh, stride_kt,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, PAGED, False,
                                  DOT_PRECISION)
    acc, m_i, l_i = _attend_tiles(q, acc, m_i, l_i, k_ptr, v_ptr, block_tables_ptr, seq,
                                  stride_bt, q_start, kv_head, full_end, kv_end, seq_len, q_pos,
                                  scale_log2, stride_kb, stride_ks, stride_kh, stride_kt,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, PAGED, True,
                                  DOT_PRECISION)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_mask[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs use exact fp32 products (tf32 would cost float32 its HF parity)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_config(group: int, block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles sized for Hopper's registers and shared memory."""
    wide = dtype == torch.float32 or block_d > 128
    block_m = 64 if wide else 128
    block_m = max(block_m, next_power_of_2(group))
    block_n = 32 if wide else 64
    return block_m, block_n, 4 if block_m * block_d <= 64 * 128 else 8


def query_tile_tokens(num_q_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> int:
    """Tokens of one sequence a prefill program owns (``BLOCK_Q``): the tile list's unit."""
    group = num_q_heads // num_kv_heads
    block_m, _, _ = _tile_config(group, next_power_of_2(head_dim), dtype)
    return block_m // group


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, block_tables: torch.Tensor | None,
                            seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor,
                            tiles: torch.Tensor, num_tiles: int, tile_tokens: int,
                            block_size: int, scale: float) -> None:
    """Fill the rows of ``out`` ``[T, Hq, D]`` that ``tiles`` covers with causal attention of
    q ``[T, Hq, D]``.

    ``tiles`` is the int32 list from ``prefill_tiles.fill_prefill_tiles`` with ``tile_tokens`` tokens a
    tile (``query_tile_tokens`` of these shapes); ``num_tiles`` programs per KV head are
    launched (a graph passes the bound, its unused entries ``-1``).
    Paged mode (``block_tables`` given): k/v are the cache halves ``[num_blocks,
    block_size, Hkv, D]`` and already hold this step's tokens. Unpaged mode (``None``):
    k/v are this step's ``[T, Hkv, D]`` and every sequence is a full prefill (the
    profiling run before a cache exists).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0 or num_tiles == 0:
        return
    num_kv_heads = k.shape[-2]
    group = num_q_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    block_m, block_n, num_warps = _tile_config(group, block_d, q.dtype)
    block_q = block_m // group
    if tile_tokens != block_q:
        raise ValueError(f"tiles of {tile_tokens} tokens; this kernel's are {block_q}")
    assert tiles.dtype == torch.int32 and tiles.shape[0] >= 2 * num_tiles
    paged = block_tables is not None
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k.stride() == v.stride()
    if paged:
        assert block_tables is not None and seq_lens is not None
        stride_kb, stride_ks, stride_kh, stride_kt = k.stride(0), k.stride(1), k.stride(2), 0
        stride_bt = block_tables.stride(0)
    else:
        block_tables, seq_lens = query_start_loc, query_start_loc  # unused placeholders
        stride_kb, stride_ks, stride_kh, stride_kt = 0, 0, k.stride(1), k.stride(0)
        stride_bt = 0
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, k, v, out, block_tables, seq_lens, query_start_loc, tiles, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_kb, stride_ks, stride_kh, stride_kt, stride_bt,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps)
