"""Batch-1 decode: the split-KV merge of attention folded into the o projection, which is
split over the query heads and summed by float32 atomics.

Why: at batch 1 attention ends in two kernels (the split-KV decode kernel, then the merge
of its splits) and the o projection GEMV can only start once the merge has finished: one
more kernel boundary on the chain, with HBM idle across it. Here program ``(h, j)``
merges head ``h``'s splits itself (a few KB from L2: the merge is repeated by every
program of the head, which is cheap next to a boundary), multiplies the merged head,
rounded to the model dtype as the merge kernel rounds it, by its ``HEAD_DIM x BLOCK_O``
slice of ``W_o`` and adds the ``BLOCK_O`` partial sums into a float32 accumulator
``[1, H]``, which must be zero on entry (``rms_norm(clear=...)`` zeroes it in the norm
before qkv) and is rounded by its consumer, the next norm, where the o GEMV rounds.

Only the order of the float32 additions differs from merge + GEMV (and varies from run to
run: atomics land in arrival order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine_core.kernels.paged_decode import SPLIT_CHUNK, _fold_splits, _splits_used
from engine_core.kernels.pdl import launch_dependents, pdl_args, wait_for_predecessor

_ROW_MAX_START = tl.constexpr(-1.0e30)


@triton.jit
def _w_tile(w_ptr, in_idx, d_ok, outs, o_ok, stride_w, W_TRANSPOSED: tl.constexpr):
    """W_o's ``[HEAD_DIM, BLOCK_O]`` slice (inputs x outputs) for one head and output block."""
    if W_TRANSPOSED:  # stored [in, out]
        at = w_ptr + in_idx.to(tl.int64)[:, None] * stride_w + outs[None, :]
    else:  # stored [out, in] (the checkpoint's layout)
        at = w_ptr + outs.to(tl.int64)[None, :] * stride_w + in_idx[:, None]
    return tl.load(at, mask=d_ok[:, None] & o_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_o_kernel(attn_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, w_ptr, acc_ptr,
                    num_splits, n_out, stride_w, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                    BLOCK_O: tl.constexpr, W_TRANSPOSED: tl.constexpr,
                    PRELOAD_W: tl.constexpr, USE_PDL: tl.constexpr):
    head = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    in_idx = head * HEAD_DIM + dims
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = outs < n_out
    if PRELOAD_W:  # weights are written by no kernel: loaded while attention finishes
        w = _w_tile(w_ptr, in_idx, d_ok, outs, o_ok, stride_w, W_TRANSPOSED)
    wait_for_predecessor(USE_PDL, False)
    if not PRELOAD_W:  # requested before the merge's loads return
        w = _w_tile(w_ptr, in_idx, d_ok, outs, o_ok, stride_w, W_TRANSPOSED)
    seq_len = tl.load(seq_lens_ptr)
    chunk = tl.arange(0, SPLIT_CHUNK)
    base = head.to(tl.int64) * num_splits
    in_row = chunk < num_splits
    lse = tl.load(part_lse_ptr + base + chunk, mask=in_row, other=-float("inf"))
    partial = tl.load(part_out_ptr + (base + chunk)[:, None] * BLOCK_D + dims[None, :],
                      mask=in_row[:, None], other=0.0)
    used_splits = _splits_used(seq_len, num_splits, BLOCK_N)[1]
    dtype = attn_ptr.dtype.element_ty
    if used_splits <= 1:  # the decode kernel wrote the head's output itself
        attn = tl.load(attn_ptr + in_idx, mask=d_ok, other=0.0).to(tl.float32)
    else:  # as _merge_splits_kernel merges, then rounded as it stores
        row_max = tl.max(tl.full([SPLIT_CHUNK], _ROW_MAX_START, tl.float32), 0)
        norm = tl.sum(tl.zeros([SPLIT_CHUNK], tl.float32), 0)
        merged = tl.zeros([BLOCK_D], tl.float32)
        row_max, norm, merged = _fold_splits(lse, partial, chunk < used_splits, row_max,
                                             norm, merged)
        for first in range(SPLIT_CHUNK, used_splits, SPLIT_CHUNK):
            splits = first + chunk
            valid = splits < used_splits
            lse = tl.load(part_lse_ptr + base + splits, mask=valid, other=-float("inf"))
            partial = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_D
                              + dims[None, :], mask=valid[:, None], other=0.0)
            row_max, norm, merged = _fold_splits(lse, partial, valid, row_max, norm, merged)
        attn = (merged / tl.where(norm > 0.0, norm, 1.0)).to(dtype).to(tl.float32)
    part = tl.sum(w.to(tl.float32) * attn[:, None], 0)
    tl.atomic_add(acc_ptr + outs, part, mask=o_ok, sem="relaxed")
    launch_dependents(USE_PDL)


class MergeOTiling(NamedTuple):
    """Outputs a program, warps; whether W is loaded before the PDL wait."""

    block_o: int
    num_warps: int
    preload_w: bool


DEFAULT_TILING = MergeOTiling(128, 4, False)


def merge_o_proj(attn: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                 seq_lens: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor,
                 decode_block_n: int, tiling: MergeOTiling | None = None,
                 w_transposed: bool = False) -> torch.Tensor:
    """Add ``o_proj(merge(splits))`` of the one decode sequence to ``acc`` ``[1, H]``.

    ``attn`` ``[1, Hq, D]`` is what the decode kernel wrote when one split held the whole
    context; ``part_out`` ``[1, Hq, splits, BLOCK_D]`` and ``part_lse`` ``[1, Hq, splits]``
    its partials otherwise (``paged_decode_attention(..., merge=False)``);
    ``decode_block_n`` the decode launch's ``BLOCK_N`` (it sets how positions were split).
    ``weight`` is ``[H, Hq * D]`` or, with ``w_transposed``, ``[Hq * D, H]``.
    """
    _, num_q_heads, head_dim = attn.shape
    num_splits = part_lse.shape[-1]
    n_out = weight.shape[1 if w_transposed else 0]
    assert attn.shape[0] == 1 and seq_lens.shape[0] == 1 and attn.is_contiguous()
    assert part_out.shape[:3] == (1, num_q_heads, num_splits) and part_out.is_contiguous()
    assert part_lse.is_contiguous() and weight.stride(1) == 1
    assert weight.shape == ((num_q_heads * head_dim, n_out) if w_transposed
                            else (n_out, num_q_heads * head_dim))
    assert acc.dtype == torch.float32 and acc.shape == (1, n_out) and acc.is_contiguous()
    t = tiling or DEFAULT_TILING
    _merge_o_kernel[(num_q_heads, triton.cdiv(n_out, t.block_o))](
        attn, part_out, part_lse, seq_lens, weight, acc, num_splits, n_out, weight.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=part_out.shape[-1], BLOCK_N=decode_block_n,
        SPLIT_CHUNK=SPLIT_CHUNK, BLOCK_O=t.block_o, W_TRANSPOSED=w_transposed,
        PRELOAD_W=t.preload_w, num_warps=t.num_warps, enable_fp_fusion=False,
        **pdl_args(attn.device))
    return acc
