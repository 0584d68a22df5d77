"""The decode step's SwiGLU MLP in one launch: gate/up, ``silu(gate) * up`` and down,
the down projection split over the intermediate dimension and summed by float32 atomics.

Why: at batch 1 the MLP is two weight-streaming GEMVs (gate/up, then down), and the down
GEMV may only start once every gate/up program has finished: the last wave of gate/up and
the first of down leave HBM part idle at the boundary (a few microseconds a layer, ~3 us of
a ~147 us Qwen3-8B layer on an H100). Here program ``p`` owns intermediate columns
``[p * BLOCK_I, (p + 1) * BLOCK_I)``: it streams their gate and up rows, forms its slice of
``silu(gate) * up`` (rounded as the separate kernels round), then streams the matching
``BLOCK_I`` input columns of the down weight and adds its partial down products into a
float32 accumulator ``[M, H]``. No program waits for another, so the weight stream does
not stop between the two projections.

The accumulator must be zero when the kernel starts (``rms_norm(clear=...)`` zeroes it in
the norm before the MLP) and holds the down projection's float32 sums when it ends; its
consumer rounds it to the model dtype first, which is where the separate down GEMV rounds.
Only the order of the float32 additions differs from the separate GEMVs (and varies from
run to run: atomics land in arrival order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine_core.kernels.gemv import BLOCK_M, _prefetch_first_lines, prefetch_args
from engine_core.kernels.pdl import launch_dependents, pdl_args, wait_for_predecessor
from engine_core.kernels.silu_mul import silu_times_up


@triton.jit
def _split_k_mlp_kernel(x_ptr, wgu_ptr, wd_ptr, acc_ptr, M, N_INTER, K, H, stride_xm, stride_wgu,
                        stride_wd, stride_am, DOWN_TRANSPOSED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_H: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                        LINE: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    # Gate/up: lane 2j reads gate row c_j, lane 2j + 1 up row c_j (as gemv's SILU_MUL).
    lanes = tl.arange(0, 2 * BLOCK_I)
    cols = pid * BLOCK_I + lanes // 2
    col_ok = cols < N_INTER
    gu_rows = wgu_ptr + (cols + (lanes % 2) * N_INTER).to(tl.int64)[:, None] * stride_wgu
    if USE_PDL and PREFETCH_LINES > 0:
        _prefetch_first_lines(gu_rows, col_ok, K, PREFETCH_LINES, LINE)
    wait_for_predecessor(USE_PDL, EARLY_DEPENDENTS)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_I], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(gu_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    dtype = x_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_I, 2]))
    act = silu_times_up(gate, up, dtype)  # [BLOCK_M, BLOCK_I]; columns past N_INTER are 0
    # Down: this program's BLOCK_I input columns of W_down, BLOCK_H outputs at a time.
    icols = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    icol_ok = icols < N_INTER
    acc_rows = acc_ptr + rows.to(tl.int64)[:, None] * stride_am
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        if DOWN_TRANSPOSED:  # stored [I, H]: a program's slice is BLOCK_I whole rows
            wd_at = wd_ptr + icols.to(tl.int64)[:, None] * stride_wd + hs[None, :]
        else:  # stored [H, I] (the checkpoint's layout): BLOCK_I columns of every row
            wd_at = wd_ptr + hs.to(tl.int64)[None, :] * stride_wd + icols[:, None]
        wd = tl.load(wd_at, mask=icol_ok[:, None] & h_ok[None, :], other=0.0)
        part = tl.dot(act, wd)
        tl.atomic_add(acc_rows + hs[None, :], part, mask=row_ok[:, None] & h_ok[None, :],
                      sem="relaxed")
    if not EARLY_DEPENDENTS:
        launch_dependents(USE_PDL)


# GPUs (torch.cuda.get_device_name) on which the model takes these kernels by default
# (--split-k-mlp auto). H100 SXM, Qwen3-8B at ctx 1k: b1 step 5.73 -> 5.58 ms, b2-b8
# 0.4-1% faster. Not the H200: there every one-launch tiling lost in the layer graph
# (107.5-108.3 -> 109.2-135.7 us a layer) and the b1 step goes 4.20 -> 4.41 ms.
SPLIT_K_MLP_DEVICES = frozenset({"NVIDIA H100 80GB HBM3"})


def split_k_mlp_pays(device: torch.device) -> bool:
    """Whether ``device`` is one of ``SPLIT_K_MLP_DEVICES``."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_name(device) in SPLIT_K_MLP_DEVICES


class SplitKMlpTiling(NamedTuple):
    """Intermediate columns a program, gate/up K chunk, down output chunk, warps, stages."""

    block_i: int
    block_k: int
    block_h: int
    num_warps: int
    num_stages: int


DEFAULT_TILING = SplitKMlpTiling(32, 256, 256, 4, 4)
# Rows up to which the model takes this launch; more take gate/up's GEMV and
# ``split_k_gemv_t`` (its float32 atomics, one set a 32-column intermediate slice, grow with
# the rows: Qwen3-8B on an H100, b6-b8 steps 6% slower than the two GEMVs).
SPLIT_K_MAX_ROWS = 2


def split_k_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                acc: torch.Tensor, tiling: SplitKMlpTiling | None = None,
                down_transposed: bool = False, prefetch_chunks: int = 1,
                early_dependents: bool = False, pdl: bool = True) -> torch.Tensor:
    """Add ``down(silu(gate(x)) * up(x))`` to the float32 ``acc`` ``[M, H]`` (zero on entry
    for the MLP alone) and return it; ``x`` ``[M, K]`` with ``M <= 16``, ``gate_up``
    ``[2 * I, K]`` (gate rows first), ``down`` ``[H, I]`` or, with ``down_transposed``,
    ``[I, H]`` (contiguous: a program's slice is then one contiguous run); ``pdl`` as
    ``pdl.pdl_args``."""
    m, k = x.shape
    n2 = gate_up.shape[0]
    inter = n2 // 2
    h = down.shape[0 if not down_transposed else 1]
    assert m <= BLOCK_M and gate_up.shape[1] == k and n2 % 2 == 0
    assert down.shape == ((inter, h) if down_transposed else (h, inter))
    assert x.stride(1) == 1 and gate_up.stride(1) == 1 and down.stride(1) == 1
    assert acc.dtype == torch.float32 and acc.shape == (m, h) and acc.stride(1) == 1
    if m == 0:
        return acc
    t = tiling or DEFAULT_TILING
    _split_k_mlp_kernel[(triton.cdiv(inter, t.block_i),)](
        x, gate_up, down, acc, m, inter, k, h, x.stride(0), gate_up.stride(0),
        down.stride(0), acc.stride(0), DOWN_TRANSPOSED=down_transposed, BLOCK_M=BLOCK_M,
        BLOCK_I=t.block_i, BLOCK_K=t.block_k, BLOCK_H=t.block_h,
        **prefetch_args(t.block_k, gate_up.element_size(), prefetch_chunks),
        EARLY_DEPENDENTS=early_dependents,
        num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=False,
        **pdl_args(x.device, pdl))
    return acc


@triton.jit
def _split_k_gemv_t_kernel(x_ptr, wt_ptr, acc_ptr, M, N, K, stride_xm, stride_wt, stride_am,
                           K_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           USE_PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_lo = tl.program_id(1) * K_PER_PROGRAM
    wait_for_predecessor(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_PER_PROGRAM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(wt_ptr + ks.to(tl.int64)[:, None] * stride_wt + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, w)
    tl.atomic_add(acc_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :], acc,
                  mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


class SplitKGemvTiling(NamedTuple):
    """Output columns a program, K rows a program, K chunk, warps, stages."""

    block_n: int
    k_per_program: int
    block_k: int
    num_warps: int
    num_stages: int


GEMV_T_TILING = SplitKGemvTiling(128, 1024, 32, 4, 4)


def split_k_gemv_t(x: torch.Tensor, weight_t: torch.Tensor, acc: torch.Tensor,
                   tiling: SplitKGemvTiling | None = None, pdl: bool = True) -> torch.Tensor:
    """Add ``x @ weight_t`` to the float32 ``acc`` ``[M, N]`` and return it: ``x`` ``[M, K]``
    with ``M <= 16``, ``weight_t`` a contiguous ``[K, N]`` (a projection's weight stored
    transposed). Programs own ``block_n`` columns and ``k_per_program`` rows of it, so
    each streams whole runs of rows and the K slices meet in float32 atomics.

    Why: the MLP of three to eight rows, with the down weight in the split-K layout
    (``split_k_mlp`` pays float32 atomics per intermediate slice, which grow with the
    rows), runs gate/up's GEMV and then this. ``pdl`` as ``pdl.pdl_args``."""
    m, k = x.shape
    n = weight_t.shape[1]
    assert m <= BLOCK_M and weight_t.shape[0] == k and weight_t.is_contiguous()
    assert x.stride(1) == 1 and acc.dtype == torch.float32 and acc.shape == (m, n)
    assert acc.stride(1) == 1
    if m == 0:
        return acc
    t = tiling or GEMV_T_TILING
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(k, t.k_per_program))
    _split_k_gemv_t_kernel[grid](
        x, weight_t, acc, m, n, k, x.stride(0), weight_t.stride(0), acc.stride(0),
        K_PER_PROGRAM=t.k_per_program, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        **pdl_args(x.device, pdl))
    return acc
