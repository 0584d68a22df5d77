"""``y = f(x) @ W^T (+ b)`` for a few rows of ``x``: the decode step's weight-streaming GEMV.

Why: with one to a few rows a projection is bound by reading ``W`` once, but cuBLAS picks
tiles for general GEMMs: on an H200 it took 12.5 us for Qwen3-0.6B's 4 MB o_proj at one
row (this kernel: 4.4 us) and adds a split-K reduce kernel for some shapes. This kernel
gives each program ``BLOCK_N`` output columns and streams their rows of ``W`` in
``BLOCK_K`` chunks, all ``x`` rows at once (a ``tl.dot`` of a 16-row tile: the rows beyond
``M`` are masked), accumulating in float32 and rounding once, as cuBLAS does; only the
order of the float32 sum differs.

``f`` is the step that feeds the projection, fused so that it costs no kernel of its own
(at batch 1 each of those is a few microseconds of latency-bound work, 72 + 36 of them a
Qwen3-8B step): RMSNorm after the residual add (``gemv_add_norm``, the pre-norm block's
``norm(x + residual)``; program 0 also stores ``x + residual``), RMSNorm alone
(``gemv_norm``), or SwiGLU's ``silu(gate) * up`` (``gemv_silu_mul``). The input is only a
few KB and every program reads all of it anyway, so each program recomputes ``f`` on its
chunks, rounding exactly where the unfused kernels (rms_norm.py, silu_mul.py) round; the
norm's sum of squares is one more pass over the row before the main loop.

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

# What is applied to the input rows before the projection.
PROLOGUE_NONE = 0
PROLOGUE_NORM = 1
PROLOGUE_ADD_NORM = 2
PROLOGUE_SILU_MUL = 3


@triton.jit
def _raw_input(x_ptr, r_ptr, x_rows, r_rows, ks, mask, K, PROLOGUE: tl.constexpr):
    """The chunk ``ks`` of the rows before the norm (in x's dtype, as float32)."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE == 2:  # x + residual, rounded as torch rounds the sum
        r = tl.load(r_rows + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    if PROLOGUE == 3:  # silu(gate) * up; the up half starts K columns on
        up = tl.load(x_rows + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        x = (silu * up).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _input(x_ptr, r_ptr, g_ptr, x_rows, r_rows, ks, mask, k_ok, K, rstd,
           PROLOGUE: tl.constexpr):
    """The chunk ``ks`` of ``f(x)`` in x's dtype, as the projection consumes it."""
    dtype = x_ptr.dtype.element_ty
    x = _raw_input(x_ptr, r_ptr, x_rows, r_rows, ks, mask, K, PROLOGUE)
    if PROLOGUE == 1 or PROLOGUE == 2:
        g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = g[None, :] * (x * rstd[:, None]).to(dtype).to(tl.float32)
    return x.to(dtype)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, out_ptr, r_out_ptr, M, N, K,
                 stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * stride_rm
    ks0 = tl.arange(0, BLOCK_K)
    if PRELOAD:  # weights only: nothing in the step writes them
        w_first = tl.load(w_rows + ks0[None, :], mask=col_ok[:, None] & (ks0 < K)[None, :],
                          other=0.0)
    wait_for_predecessor(USE_PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            k_ok = ks < K
            mask = row_ok[:, None] & k_ok[None, :]
            h = _raw_input(x_ptr, r_ptr, x_rows, r_rows, ks, mask, K, PROLOGUE)
            sum_sq += tl.sum(h * h, 1)
            if PROLOGUE == 2:
                if pid == 0:
                    r_out = r_out_ptr + rows.to(tl.int64)[:, None] * stride_rom + ks[None, :]
                    tl.store(r_out, h.to(r_out_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRELOAD:
        k_ok = ks0 < K
        x = _input(x_ptr, r_ptr, g_ptr, x_rows, r_rows, ks0, row_ok[:, None] & k_ok[None, :],
                   k_ok, K, rstd, PROLOGUE)
        acc += tl.dot(x, tl.trans(w_first))
    for k0 in range(BLOCK_K * PRELOAD, K, BLOCK_K):
        ks = k0 + ks0
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = _input(x_ptr, r_ptr, g_ptr, x_rows, r_rows, ks, row_ok[:, None] & k_ok[None, :],
                   k_ok, K, rstd, PROLOGUE)
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


# One tiling for every shape. Narrow column blocks keep enough programs in flight to stream
# a small matrix at full bandwidth (a 1024-column matrix still gets 64 programs). Of 20
# tilings timed in CUDA graphs on an H200 (benchmarks/decode_kernels.py, one row), this one
# was within 12% of the best on all eight Qwen3-8B/0.6B projections and beat cuBLAS on all
# but the 8B's 192 MB gate/up, which ``Linear`` therefore leaves to cuBLAS.
GEMV_TILES = GemvTiling(16, 256, 2, 4)


def choose_tiling(n: int, k: int) -> GemvTiling:
    """The tiling for a weight ``[n, k]`` (shapes only: a CUDA graph records one for good)."""
    return GEMV_TILES


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            k: int, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, tiling: GemvTiling | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    n = weight.shape[0]
    assert x.dim() == 2 and m <= BLOCK_M and weight.shape[1] == k
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.dtype == x.dtype
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None \
        else None
    if m == 0:
        return out, residual_out
    r = x if residual is None else residual
    r_out = out if residual_out is None else residual_out
    assert r.stride(1) == 1
    t = tiling or choose_tiling(n, k)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, r, weight if norm_weight is None else norm_weight, weight,
        weight if bias is None else bias, out, r_out, m, n, k,
        x.stride(0), r.stride(0), r_out.stride(0), weight.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, PRELOAD=int(t.preload), num_warps=t.num_warps,
        num_stages=t.num_stages, enable_fp_fusion=False, **pdl_args(x.device))
    return out, residual_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiling: GemvTiling | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` with ``M <= 16``; ``weight`` ``[N, K]``."""
    return _launch(PROLOGUE_NONE, x, weight, bias, x.shape[1], tiling=tiling)[0]


def gemv_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
              tiling: GemvTiling | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual) @ weight.T + bias, x + residual)``, as ``rms_norm`` then
    ``gemv`` compute them; without a residual the norm is of ``x`` and the second is None.
    ``norm_weight`` must have x's dtype (the norm's output dtype is then x's)."""
    assert norm_weight.dtype == x.dtype and norm_weight.shape == (x.shape[1],)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
    prologue = PROLOGUE_NORM if residual is None else PROLOGUE_ADD_NORM
    return _launch(prologue, x, weight, bias, x.shape[1], residual, norm_weight, eps, tiling)


def gemv_silu_mul(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiling: GemvTiling | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T + bias`` for ``gate_up`` ``[M, 2K]`` (gate columns
    first), as ``silu_and_mul`` then ``gemv`` compute it."""
    assert gate_up.shape[1] % 2 == 0
    return _launch(PROLOGUE_SILU_MUL, gate_up, weight, bias, gate_up.shape[1] // 2,
                   tiling=tiling)[0]
