"""``y = x @ W^T (+ b)`` for a few rows of ``x``: the decode step's weight-streaming GEMV.

Why: with one to a few rows a projection is bound by reading ``W`` once, but cuBLAS picks
tiles for general GEMMs: on an H200 it took 12.5 us for Qwen3-0.6B's 4 MB o_proj at one
row (this kernel: 4.4 us) and adds a split-K reduce kernel for some shapes. This kernel
gives each program ``BLOCK_N`` output columns and streams their rows of ``W`` in
``BLOCK_K`` chunks, all ``x`` rows at once (a ``tl.dot`` of a 16-row tile: the rows beyond
``M`` are masked), accumulating in float32 and rounding once, as cuBLAS does; only the
order of the float32 sum differs.

Used by ``Linear`` on the Triton path for 16-bit weights up to ``GEMV_MAX_WEIGHT_ELEMENTS``
and at most ``--triton-gemv-max-rows`` rows; larger batches are GEMMs and stay with cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels.gemv_tilings import GemvTiling, choose_tiling
from engine_core.kernels.pdl import (
    launch_dependents,
    pdl_args,
    prefetch_l2,
    wait_for_predecessor,
)
from engine_core.kernels.silu_mul import silu_times_up

BLOCK_M = 16  # tl.dot's smallest tile; rows beyond M are masked loads


@triton.jit
def _prefetch_first_lines(w_rows, row_ok, K, LINES: tl.constexpr, LINE: tl.constexpr):
    """The first ``LINES`` 128-byte lines of each of this program's rows of W requested into
    L2 (fire and forget: no registers, nothing waits)."""
    cols = tl.arange(0, LINES) * LINE
    addr = w_rows + cols[None, :]
    prefetch_l2(addr, row_ok[:, None] & (cols < K)[None, :])


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
                 PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr):
    lanes = tl.arange(0, BLOCK_N)
    if SILU_MUL:
        # N = 2 * I weight rows (gate rows, then up rows); I outputs. Lane 2j reads gate row
        # c_j and lane 2j + 1 up row c_j, so both halves of an output sit in one tile.
        half = N // 2
        cols = tl.program_id(0) * (BLOCK_N // 2) + lanes // 2
        col_ok = cols < half
        w_idx = cols + (lanes % 2) * half
    else:
        cols = tl.program_id(0) * BLOCK_N + lanes
        col_ok = cols < N
        w_idx = cols
    w_rows = w_ptr + w_idx.to(tl.int64)[:, None] * stride_wn
    if USE_PDL and PREFETCH_LINES > 0:
        # Weights are written by no kernel, so their first lines may be requested before
        # the wait: they land in L2 while the predecessor finishes.
        _prefetch_first_lines(w_rows, col_ok, K, PREFETCH_LINES, LINE)
    wait_for_predecessor(USE_PDL, EARLY_DEPENDENTS)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if not EARLY_DEPENDENTS:
        launch_dependents(USE_PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_idx, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty  # rounded to the model dtype, then stored as out's
    if SILU_MUL:
        # Rounded where the unfused path rounds: the projection's output, then silu(gate).
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32),
                                       [BLOCK_M, BLOCK_N // 2, 2]))
        result = silu_times_up(gate, up, dtype)
        out_cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out_ok = out_cols < half
    else:
        result = acc.to(dtype)
        out_cols = cols
        out_ok = col_ok
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + out_cols[None, :]
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


# K chunks of its rows of W each program requests into L2 before its PDL wait, while the
# predecessor (a norm, the split merge, gate/up) still runs and HBM would idle: the loop's
# first loads then find them in L2. H100, Qwen3-8B layer graph at batch 1: 150.1-150.7 us
# a layer without, 148.3-148.5 with one chunk, 148.1-150.3 with two, 150.0-152.4 with four,
# 156.2 with eight (more requests than the window hides); the 8B b1 step 5.849-5.851 ->
# 5.784 ms with one chunk.
PREFETCH_CHUNKS = 1


def prefetch_args(block_k: int, element_size: int,
                  chunks: int = PREFETCH_CHUNKS) -> dict[str, int]:
    """A kernel's ``PREFETCH_LINES`` and ``LINE`` (elements a 128-byte line) for ``chunks``
    K chunks of ``block_k`` over weights of ``element_size`` bytes (``_prefetch_first_lines``:
    this GEMV's and ``split_k_mlp``'s)."""
    assert chunks >= 0 and chunks & (chunks - 1) == 0, chunks  # tl.arange: 2^n lines a row
    return {"PREFETCH_LINES": chunks * block_k * element_size // 128,
            "LINE": 128 // element_size}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiling: GemvTiling | None = None, silu_mul: bool = False,
         early_dependents: bool | None = None,
         prefetch_chunks: int | None = None,
         out_dtype: torch.dtype | None = None, pdl: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` with ``M <= 16``; ``weight`` ``[N, K]``.

    ``silu_mul``: ``weight`` is a fused gate/up ``[2 * I, K]`` (gate rows first) and the
    result is ``silu(gate) * up`` ``[M, I]``, as ``silu_mul.silu_and_mul`` of the plain
    projection would give, without its launch and the ``[M, 2 * I]`` round trip.

    ``early_dependents`` (with PDL): let the next kernel's blocks be scheduled once this
    one's have started (True) or only after their main loop (False). None: early, except
    with ``silu_mul``, whose successor is the down projection's GEMV: scheduled early, its
    programs pile onto the SMs that gate/up frees first and stream at a fraction of the
    bandwidth (Qwen3-8B layer graph on an H200: 132.2 us a layer, 112.6 with the late
    trigger, against 113.9 with the separate SiLU kernel).

    ``prefetch_chunks``: K chunks of each program's rows of ``weight`` requested into L2
    before the PDL wait (a power of two; None: ``PREFETCH_CHUNKS``; only with PDL).

    ``out_dtype`` (the LM head's float32 logits): the result, rounded to ``x``'s dtype as
    always, is stored in this dtype, so no cast kernel follows. ``pdl``: launch with PDL
    where the device has it (``pdl.pdl_args``).
    """
    m, k = x.shape
    n = weight.shape[0]
    assert m <= BLOCK_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert not silu_mul or n % 2 == 0
    out = torch.empty(m, n // 2 if silu_mul else n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiling or choose_tiling(n, k)
    chunks = PREFETCH_CHUNKS if prefetch_chunks is None else prefetch_chunks
    early = not silu_mul if early_dependents is None else early_dependents
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, EARLY_DEPENDENTS=early,
        **prefetch_args(t.block_k, weight.element_size(), chunks), BLOCK_M=BLOCK_M,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        enable_fp_fusion=not silu_mul, **pdl_args(x.device, pdl))
    return out
