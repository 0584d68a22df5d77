"""``y = x @ W^T (+ b)`` for a few rows of ``x``: the decode step's weight-streaming GEMV.

Why: with one to a few rows a projection is bound by reading ``W`` once, but cuBLAS picks
tiles for general GEMMs: on an H200 it took 12.5 us for Qwen3-0.6B's 4 MB o_proj at one
row (this kernel: 4.4 us) and adds a split-K reduce kernel for some shapes. This kernel
gives each program ``BLOCK_N`` output columns and streams their rows of ``W`` in
``BLOCK_K`` chunks, all ``x`` rows at once (a ``tl.dot`` of a 16-row tile: the rows beyond
``M`` are masked), accumulating in float32 and rounding once, as cuBLAS does; only the
order of the float32 sum differs.

``PRELOAD``: the first chunk of ``W`` is loaded before the PDL wait. The weights are not
written by any kernel of a step, so this is safe, and those loads overlap the predecessor's
tail instead of starting after it.

Used by ``Linear`` on the Triton path for 16-bit weights up to ``GEMV_MAX_WEIGHT_ELEMENTS``
and at most ``--triton-gemv-max-rows`` rows; larger batches are GEMMs and stay with cuBLAS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

BLOCK_M = 16  # tl.dot's smallest tile; rows beyond M are masked loads

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, W_EVICTION: tl.constexpr,
                 USE_PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    ks0 = tl.arange(0, BLOCK_K)
    if PRELOAD:  # weights only: nothing in the step writes them
        w_first = tl.load(w_rows + ks0[None, :], mask=col_ok[:, None] & (ks0 < K)[None, :],
                          other=0.0, eviction_policy=W_EVICTION)
    wait_for_predecessor(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRELOAD:
        x = tl.load(x_rows + ks0[None, :], mask=row_ok[:, None] & (ks0 < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w_first))
    for k0 in range(BLOCK_K * PRELOAD, K, BLOCK_K):
        ks = k0 + ks0
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy=W_EVICTION)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class GemvTiling(NamedTuple):
    """A launch shape: columns and K chunk per program, warps, pipeline stages, preload."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    preload: bool = False
    evict_first: bool = False  # mark W's lines first to leave L2 (streamed once per step)


# One tiling for every shape. Narrow column blocks keep enough programs in flight to stream
# a small matrix at full bandwidth (a 1024-column matrix still gets 64 programs). Of 20
# tilings timed in CUDA graphs on an H200 (benchmarks/decode_kernels.py, one row), this one
# was within 12% of the best on all eight Qwen3-8B/0.6B projections and beat cuBLAS on all
# but the 8B's 192 MB gate/up, which ``Linear`` therefore leaves to cuBLAS.
GEMV_TILES = GemvTiling(16, 256, 2, 4)


def choose_tiling(n: int, k: int) -> GemvTiling:
    """The tiling for a weight ``[n, k]`` (shapes only: a CUDA graph records one for good)."""
    return GEMV_TILES


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiling: GemvTiling | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` with ``M <= 16``; ``weight`` ``[N, K]``."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= BLOCK_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiling or choose_tiling(n, k)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, PRELOAD=int(t.preload),
        W_EVICTION="evict_first" if t.evict_first else "",
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_args(x.device))
    return out
