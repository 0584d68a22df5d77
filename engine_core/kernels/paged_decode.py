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

Steps that are not decode-only launch instead over a work list (``attention/decode_work.py``,
``WORK_LIST``): one program per listed (sequence, split) and KV head, each row split by its
own length, partials indexed by item; the merge reads each row's first item and split count.

Decode-only steps pass ``NewTokenRope``: q arrives raw from the qkv projection and each
program norms and rotates its query heads; the split holding the last position norms and
rotates the new key, stores the new K/V at its slot and starts its softmax with that key,
so the q/k norm + RoPE kernel and the KV write are not launched (rounded as they round).
With one sequence cut into splits (batch-1 decode, ``early_kv_launch``) each split also
reads its extent and loads its first K/V tile before its PDL wait, which the qkv GEMV
before it cannot change (``kernels/pdl.py``'s rule).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_core.attention.decode_work import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, DecodeWork
from engine_core.kernels import next_power_of_2
from engine_core.kernels.paged_prefill import LOG2E, dot_precision
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

# MIN_TOKENS_PER_SPLIT: a split below it costs more in the merge than it gains in
# parallelism. MAX_SPLITS: an H200 sweep (32 q / 8 KV heads, d 128, bf16) ran one 32k-token
# sequence in 0.14 ms with 16 splits and 0.09 ms with 33 (the occupancy bound below); batches
# gained nothing from more. Both are shared with the work list (attention/decode_work.py).
# The merge walks a row's splits this many at a time: one compiled variant for any count,
# and a tile sized for the usual few splits (one 64-wide tile cost batches of 4-16
# sequences 1-2 us a layer on an H200 against tiles padded to their own count).
SPLIT_CHUNK = 16
MERGE_WARPS = 2
_ROW_MAX_START = tl.constexpr(-1.0e30)


@triton.jit
def _load_head_rows(row_ptrs, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of heads ``[R, D]`` at ``row_ptrs`` ``[R]`` and the same rows with their halves
    swapped (what RoPE pairs each dimension with), float32."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    half = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    mask = row_ok[:, None] & dim_ok[None, :]
    x = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, xp


@triton.jit
def _norm_rope(x, xp, w_ptr, cos, sin, eps, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """``_load_head_rows``' rows per-head RMSNorm'd (with ``HAS_NORM``) and rotated (neox
    halves), rounded where ``rotary.apply_rope`` rounds; in ``dtype``."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    half = HEAD_DIM // 2
    if HAS_NORM:
        partner = tl.where(dims < half, dims + half, dims - half)
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        x = (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated = tl.where((dims < half)[None, :], -xp, xp)
    out = (x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)
    return out.to(dtype)


@triton.jit
def _splits_used(seq_len, row_splits, BLOCK_N: tl.constexpr):
    """(positions per split, splits that hold any) of a row cut into ``row_splits``.

    The grid's split count follows shapes, not lengths: the splits past the context have
    nothing to do, so they leave at once and the merge reads only the others (Qwen3-8B at
    one 1k sequence: 16 of 33 on an H100). A row of ``seq_len`` 0 keeps one split, which
    writes zeros.
    """
    per_split = tl.cdiv(tl.cdiv(seq_len, row_splits), BLOCK_N) * BLOCK_N
    return per_split, tl.maximum(tl.cdiv(seq_len, tl.maximum(per_split, 1)), 1)


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One tile of K/V ``[N, D]`` (positions where ``valid``) folded into the online
    softmax's (max, normaliser, weighted sum) of the query rows ``q``."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(valid[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ``num_splits`` is a plain argument, never specialised on: it follows the batch size, and
# as a compile-time constant every new eager batch size compiled another variant while
# serving (~1 s each; 13 in the first seconds of a 200 req/s run on an H200).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_bt,
                   k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps, slot_ptr,
                   stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ct, stride_st,
                   work_ptr, num_splits,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
                   WORK_LIST: tl.constexpr, EARLY_KV: tl.constexpr, USE_PDL: tl.constexpr):
    kv_head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    if ROPE and EARLY_KV:
        # Before the wait: the predecessor (the qkv GEMV) writes neither the step's inputs
        # (seq_lens, block tables: copied before the step) nor the cache's older positions
        # (written by earlier steps; this step's new K/V is stored by this kernel), so the
        # split's extent and its first tile of K/V are requested while the GEMV finishes.
        # A split past the context leaves here, freeing its slot for the others.
        seq = tl.program_id(0)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        per_split, used_splits = _splits_used(seq_len, num_splits, BLOCK_N)
        if split >= used_splits:  # never split 0: every row still waits for its q
            return
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        cached_hi = tl.minimum(hi, seq_len - 1)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        pos0 = lo + tl.arange(0, BLOCK_N)
        valid0 = pos0 < cached_hi
        block0 = tl.load(table + pos0 // BLOCK_SIZE, mask=valid0, other=0).to(tl.int64)
        kv_rows0 = block0 * stride_kb + (pos0 % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        tile_mask0 = valid0[:, None] & dim_mask[None, :]
        k0 = tl.load(k_cache_ptr + kv_rows0[:, None] + dims[None, :], mask=tile_mask0,
                     other=0.0)
        v0 = tl.load(v_cache_ptr + kv_rows0[:, None] + dims[None, :], mask=tile_mask0,
                     other=0.0)
    wait_for_predecessor(USE_PDL)
    if WORK_LIST:
        # One listed (sequence, split, its row's split count); partials by item.
        item = tl.program_id(0)
        seq = tl.load(work_ptr + 3 * item)
        if seq < 0:  # past this step's items (a graph's grid covers the most it can need)
            return
        split = tl.load(work_ptr + 3 * item + 1)
        row_splits = tl.load(work_ptr + 3 * item + 2)
        part_base = item.to(tl.int64) * NUM_Q_HEADS
        part_head_stride = 1
    else:
        seq = tl.program_id(0)
        split = tl.program_id(2)
        row_splits = num_splits
        part_base = seq.to(tl.int64) * NUM_Q_HEADS * num_splits + split
        part_head_stride = num_splits
    q_row = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    if ROPE:
        # What the prologue needs is requested before any branch, so that it arrives in one
        # memory round trip instead of one after each test: the row's length and the new
        # token's q, k, v, cos, sin and slot. A decode-only step (the ROPE contract) has one
        # token a row, so row ``seq``'s token is token ``seq``; a row whose bounds say
        # otherwise is skipped, never read with the wrong token. (Without ROPE the length
        # stays behind the test: hoisted there, batches of 64 and 256 lost 12% on an H100.)
        if not EARLY_KV:
            seq_len = tl.load(seq_lens_ptr + seq)
        token = seq.to(tl.int64)
        one = tl.arange(0, 1)
        cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dim_mask, other=0.0)
        sin = tl.load(sin_ptr + token * stride_st + dims, mask=dim_mask, other=0.0)
        q_raw, q_partner = _load_head_rows(q_ptr + token * stride_qt + head * stride_qh,
                                           row_valid, HEAD_DIM, BLOCK_D)
        k_raw, k_partner = _load_head_rows(
            k_new_ptr + token * stride_knt + kv_head * stride_knh + one * 0, one == 0,
            HEAD_DIM, BLOCK_D)
        v_new = tl.load(v_new_ptr + token * stride_vnt + kv_head * stride_vnh
                        + one[:, None] * 0 + dims[None, :], mask=dim_mask[None, :], other=0.0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if (q_row != seq) | (q_end != seq + 1):
            return
    else:
        if q_end - q_row != 1:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
    if not (ROPE and EARLY_KV):
        per_split, used_splits = _splits_used(seq_len, row_splits, BLOCK_N)
        if split >= used_splits:
            return
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        cached_hi = hi
        if ROPE:
            cached_hi = tl.minimum(hi, seq_len - 1)

    m_i = tl.full([GROUP_PAD], _ROW_MAX_START, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    if ROPE:
        # q, k and v are this step's raw projections: q is normed and rotated here, and the
        # new token (position seq_len - 1) is taken from registers, not from the cache; the
        # split holding that position stores the new K/V into the cache for later steps and
        # starts its softmax with that key (as the cache will give it back, fp8 included).
        cos = cos.to(tl.float32)[None, :]
        sin = sin.to(tl.float32)[None, :]
        dtype = q_ptr.dtype.element_ty
        q = _norm_rope(q_raw, q_partner, q_w_ptr, cos, sin, eps, dtype, HEAD_DIM, BLOCK_D,
                       HAS_NORM)
        k_new = _norm_rope(k_raw, k_partner, k_w_ptr, cos, sin, eps, dtype, HEAD_DIM,
                           BLOCK_D, HAS_NORM)
        new_pos = seq_len - 1 + one
        owner = (new_pos >= lo) & (new_pos < hi)  # [1]
        cache_dtype = k_cache_ptr.dtype.element_ty
        k_stored = k_new.to(cache_dtype)
        v_stored = v_new.to(cache_dtype)
        dst = ((slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
               + kv_head * stride_kh + one[:, None] * 0 + dims[None, :])
        # Masks stay [1, D] tensors: the Triton 3.6 interpreter turns a tensor mask
        # combined with a scalar condition into integers, which tl.store rejects.
        store_ok = (owner & (slot + one >= 0))[:, None] & dim_mask[None, :]
        tl.store(k_cache_ptr + dst, k_stored, mask=store_ok)
        tl.store(v_cache_ptr + dst, v_stored, mask=store_ok)
        k_use = k_stored.to(q.dtype).to(tl.float32)
        s_new = tl.sum(q.to(tl.float32) * k_use, 1) * scale_log2
        m_i = tl.where(owner, s_new, m_i)
        l_i = tl.where(owner, 1.0, l_i)
        acc = tl.where(owner[:, None], v_stored.to(q.dtype).to(tl.float32), acc)
    else:
        q_rows = q_row.to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                    mask=row_valid[:, None] & dim_mask[None, :], other=0.0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first = lo
    if ROPE and EARLY_KV:  # the first tile arrived before the wait
        m_i, l_i, acc = _attend_tile(q, k0, v0, valid0, m_i, l_i, acc, scale_log2,
                                     DOT_PRECISION)
        first = lo + BLOCK_N
    for start in range(first, cached_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < cached_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        tile_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        # V is loaded beside K, before the QK^T dot (no measurable change at batch 1 on an
        # H200: a one-tile split stayed 7.7 us, latency-bound).
        v = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, scale_log2,
                                     DOT_PRECISION)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if used_splits == 1:
        o_rows = q_row.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_mask[None, :])
    else:
        # Partials in float32, contiguous: [num_seqs, Hq, num_splits, (BLOCK_D)], or with a
        # work list [items, Hq, (BLOCK_D)].
        part = part_base + head * part_head_stride
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out,
                 mask=row_valid[:, None])
        lse = tl.where(empty, -float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _fold_splits(lse, partial, valid, row_max, norm, acc):
    """Fold a chunk of splits (log-sum-exps ``[C]``, partial outputs ``[C, D]``, ``valid``
    ``[C]``) into the running (max, normaliser, weighted sum). Lanes that are not valid, or
    whose split held no position (lse -inf), are selected away rather than masked at the
    load: what they read may be anything, NaN included."""
    lse = tl.where(valid, lse, -float("inf"))
    used = lse > -float("inf")
    new_max = tl.maximum(row_max, tl.max(lse, 0))
    rescale = tl.exp2(row_max - new_max)
    weight = tl.exp2(lse - new_max)
    contribution = tl.where(used[:, None], partial, 0.0) * weight[:, None]
    acc = acc * rescale + tl.sum(contribution, 0)
    norm = norm * rescale + tl.sum(weight, 0)
    return new_max, norm, acc


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, rows_ptr,
                         seq_lens_ptr, stride_ot, stride_oh, num_splits,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr, WORK_LIST: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # The row's bounds, its length and its first chunk of splits are all requested before
    # any test (one memory round trip on the sequence grid, whose partials sit at a fixed
    # place; two with a work list, whose row entry says where).
    q_row = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WORK_LIST:  # the row's items are consecutive; a row that is not a decode has (0, 0)
        row_splits = tl.load(rows_ptr + 2 * seq + 1)
        base = tl.load(rows_ptr + 2 * seq).to(tl.int64) * NUM_Q_HEADS + head
        split_stride = NUM_Q_HEADS
    else:
        row_splits = num_splits
        base = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits
        split_stride = 1
    chunk = tl.arange(0, SPLIT_CHUNK)
    dims = tl.arange(0, BLOCK_D)
    at = base + chunk * split_stride
    in_row = chunk < row_splits
    lse = tl.load(part_lse_ptr + at, mask=in_row, other=-float("inf"))
    partial = tl.load(part_out_ptr + at[:, None] * BLOCK_D + dims[None, :],
                      mask=in_row[:, None], other=0.0)
    if q_end - q_row != 1:
        return
    used_splits = _splits_used(seq_len, row_splits, BLOCK_N)[1]
    if used_splits <= 1:  # one split wrote the output itself
        return
    # One pass, SPLIT_CHUNK splits at a time, rescaling as the running maximum grows (one
    # chunk covers the usual counts). Splits past ``used_splits`` did not run this step:
    # their entries are stale. The finite start keeps an all-empty row (seq_len 0) free of
    # -inf - -inf.
    row_max = tl.max(tl.full([SPLIT_CHUNK], _ROW_MAX_START, tl.float32), 0)
    norm = tl.sum(tl.zeros([SPLIT_CHUNK], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    row_max, norm, acc = _fold_splits(lse, partial, chunk < used_splits, row_max, norm, acc)
    for first in range(SPLIT_CHUNK, used_splits, SPLIT_CHUNK):
        splits = first + chunk
        valid = splits < used_splits
        at = base + splits * split_stride
        lse = tl.load(part_lse_ptr + at, mask=valid, other=-float("inf"))
        partial = tl.load(part_out_ptr + at[:, None] * BLOCK_D + dims[None, :],
                          mask=valid[:, None], other=0.0)
        row_max, norm, acc = _fold_splits(lse, partial, valid, row_max, norm, acc)
    out = acc / tl.where(norm > 0.0, norm, 1.0)
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
    by_occupancy = triton.cdiv(decode_work_target(num_kv_heads, device), max(num_seqs, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def decode_work_target(num_kv_heads: int, device: torch.device) -> int:
    """Programs per KV head that fill the GPU about twice: what a decode batch's splits
    (``choose_num_splits``) and a mixed step's decode work items (``attention/decode_work.py``)
    aim at."""
    num_sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    return triton.cdiv(2 * num_sms, max(num_kv_heads, 1))


def early_kv_launch(rope: bool, num_seqs: int, num_splits: int, cache_element_size: int,
                    early_kv: bool | None = None) -> tuple[bool, int]:
    """(whether each split loads its first K/V tile before the PDL wait, warps) for a
    decode launch, from shapes only (CUDA-graph safe); ``early_kv`` overrides the first.

    Why: one sequence cut into splits with RoPE in the kernel (batch-1 decode) can have
    its K/V tiles arrive while the qkv GEMV finishes, and 8 warps a split (its used splits
    fit the GPU one program an SM). H100, Qwen3-8B heads, b1 ctx 1k: 8.1-8.3 -> 6.8-7.0 us
    (7.5 with 4 warps); layer graph 149.7-149.9 -> 147.1-147.9 us. Not for batches: at b8
    the step lost 0.3% with 4 warps and 2% with 8 (an 8-warp program takes an SM's
    registers: three waves), and with one split a row the tile held across the prologue
    spilled in the loop (b64 ctx 2k: 186 -> 211 us). 8-bit caches keep 4 warps: forced to 8
    warps, every GPU test case passed but bf16 queries over an e5m2 cache (28-63% of the
    outputs wrong, with and without q/k norm; not looked into further).
    """
    early = rope and (num_seqs == 1 and num_splits > 1 if early_kv is None else early_kv)
    return early, 8 if early and num_seqs == 1 and cache_element_size >= 2 else 4


@dataclass(frozen=True)
class NewTokenRope:
    """This step's new tokens for ``paged_decode_attention`` to finish in its prologue:
    raw k/v ``[T, Hkv, D]`` (views of the qkv projection's output), cos/sin ``[T, 1, D]``
    in the model dtype, the slots to store them at (``-1``: skip), and Qwen3's per-head
    q/k norm weights ``[D]`` when the model has them.

    Why: at decode the separate q/k norm + RoPE kernel and the KV write are two more
    latency-bound launches per layer between the qkv GEMV and attention (Qwen3-8B layer
    graph on an H200: ~6 us of a ~119 us layer); each attention program can norm and rotate
    its own query heads, and the program holding the last position the new key.
    """

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           out: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None,
                           rope: NewTokenRope | None = None,
                           work: DecodeWork | None = None,
                           early_kv: bool | None = None, pdl: bool = True) -> None:
    """Fill the rows of ``out`` ``[T, Hq, D]`` of the sequences with exactly one new token.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` and already hold the
    new token, unless ``rope`` is given: then ``q`` is the raw projection, and the kernel
    norms and rotates q and the new k and stores the new k/v into the caches, as
    ``rotary.apply_rope`` then ``kv_write.write_kv`` would (every row must then be a decode
    row whose token is token i for row i, padding rows of no token after them: other rows
    get neither attention nor their K/V written).
    ``num_splits=None`` picks ``choose_num_splits``. ``work`` (mixed steps,
    ``attention/decode_work.py``) gives each decode row its own split count instead: one
    program per listed item and KV head; ``num_splits`` is then unused. ``early_kv`` and
    ``num_warps`` (benchmarks) override ``early_kv_launch``'s choice. ``pdl``: launch with
    PDL where the device has it (``pdl.pdl_args``).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if work is not None:
        assert rope is None and work.items.dtype == torch.int32
        num_splits = 1  # unused by the kernels
    elif num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1],
                                       block_size, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    block_d = next_power_of_2(head_dim)
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 or block_d > 128 else 64
    extra = {} if num_stages is None else {"num_stages": num_stages}
    launch = pdl_args(q.device, pdl)
    if work is not None:
        if work.count == 0:
            return
        part_out = torch.empty(work.count, num_q_heads, block_d, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(work.count, num_q_heads, dtype=torch.float32, device=q.device)
    elif num_splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, block_d,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if rope is not None:
        has_norm = rope.q_norm_weight is not None and rope.k_norm_weight is not None
        assert rope.k.shape == rope.v.shape == (q.shape[0], num_kv_heads, head_dim)
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1 and head_dim % 2 == 0
        assert rope.cos.stride(-1) == 1 and rope.sin.stride(-1) == 1
        assert rope.cos.dtype == q.dtype and rope.slot_mapping.shape[0] >= q.shape[0]
        assert num_seqs <= q.shape[0]  # one token a row: row i's token is token i
        new = (rope.k, rope.v, rope.cos, rope.sin,
               rope.q_norm_weight if has_norm else rope.cos,
               rope.k_norm_weight if has_norm else rope.cos, rope.eps, rope.slot_mapping,
               rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1),
               rope.cos.stride(0), rope.sin.stride(0))
        # Rounded as the RoPE kernel rounds, so without contraction: with it, 16-bit results
        # moved by a unit at rare ties on an H200 (and it bought no speed: b64 130.9 vs
        # 131.1 us).
        extra["enable_fp_fusion"] = False
    else:
        has_norm = False
        new = (q, q, q, q, q, q, 0.0, seq_lens, 0, 0, 0, 0, 0, 0)  # placeholders
    early, default_warps = early_kv_launch(rope is not None, num_seqs, num_splits,
                                           k_cache.element_size(), early_kv)
    num_warps = default_warps if num_warps is None else num_warps
    grid = ((work.count, num_kv_heads, 1) if work is not None
            else (num_seqs, num_kv_heads, num_splits))
    _decode_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens,
        query_start_loc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *new,
        seq_lens if work is None else work.items, num_splits,
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision(q.dtype), ROPE=rope is not None,
        HAS_NORM=has_norm, WORK_LIST=work is not None,
        EARLY_KV=early, num_warps=num_warps, **extra, **launch)
    if num_splits > 1 or work is not None:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, query_start_loc,
            seq_lens if work is None else work.rows, seq_lens, out.stride(0), out.stride(1),
            num_splits, NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=block_n,
            SPLIT_CHUNK=SPLIT_CHUNK, WORK_LIST=work is not None, num_warps=MERGE_WARPS,
            **launch)
