"""Row-wise argmax of logits ``[R, V]`` for greedy sampling: the first index of each row's
maximum, as ``torch.argmax`` gives (NaN counts as the maximum there, and here too).

Why: ``torch.argmax`` over one 151,936-entry row took 8.7 us on an H100 plus a memset
before it (``experiments/profile_decode.py --graphs``): one reduction kernel that
reads the row with few blocks. Here ``CHUNK``-long pieces of every row are scanned by
programs of their own and a second launch picks the best piece, both chained to the LM
head by PDL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

CHUNK = 4096  # entries a program scans: 38 programs for a 151,936-entry row
_NONE = tl.constexpr(2**31 - 1)  # "no index yet": larger than any column


@triton.jit
def _best(values, index):
    """(max, first index of it) of ``values`` ``[B]`` with their ``index``; NaN is largest."""
    top = tl.max(values, 0)
    return top, tl.min(tl.where(values == top, index, _NONE), 0)


@triton.jit
def _piece_argmax_kernel(x_ptr, val_ptr, idx_ptr, vocab, stride_r, pieces,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0)
    piece = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], -float("inf"), tl.float32)
    best_i = tl.full([BLOCK], _NONE, tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_r
    for off in range(0, CHUNK, BLOCK):
        cols = piece * CHUNK + off + lanes
        ok = cols < vocab
        v = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN: the maximum, as torch takes it
        better = ok & ((v > best_v) | (best_i == _NONE))  # a lane's columns only grow
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, cols, best_i)
    top, first = _best(best_v, best_i)
    tl.store(val_ptr + row * pieces + piece, top)
    tl.store(idx_ptr + row * pieces + piece, first)


@triton.jit
def _pick_piece_kernel(val_ptr, idx_ptr, out_ptr, pieces, BLOCK_P: tl.constexpr,
                       USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    ok = p < pieces
    v = tl.load(val_ptr + row * pieces + p, mask=ok, other=-float("inf"))
    i = tl.load(idx_ptr + row * pieces + p, mask=ok, other=_NONE)
    _, first = _best(v, i)
    tl.store(out_ptr + row, first.to(tl.int64))


def row_argmax(logits: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[R]``) for ``logits`` ``[R, V]``; ``pdl`` as
    ``pdl.pdl_args``."""
    rows, vocab = logits.shape
    assert vocab > 0
    if logits.stride(1) != 1:  # the kernels read rows as contiguous runs
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    pieces = triton.cdiv(vocab, CHUNK)
    values = torch.empty(rows, pieces, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, pieces, dtype=torch.int32, device=logits.device)
    launch = pdl_args(logits.device, pdl)
    _piece_argmax_kernel[(rows, pieces)](logits, values, index, vocab, logits.stride(0),
                                         pieces, CHUNK=CHUNK, BLOCK=1024, num_warps=4, **launch)
    _pick_piece_kernel[(rows,)](values, index, out, pieces,
                                BLOCK_P=max(16, next_power_of_2(pieces)), num_warps=1, **launch)
    return out
