"""Experiment: ``y = x @ W^T`` for one row of ``x``, with most of each program's rows of
``W`` copied into shared memory *before* its PDL wait, for the o projection after batch-1
decode attention. It lost; kept for ``decode_kernels`` (``--parts staged`` and the layer
variants "engine now, o staged ...") and docs/PERFORMANCE.md.

Why it was tried: at batch 1 decode attention and its split merge are latency-bound (~5 us
a layer on an H100) while HBM idles, and the o projection can only start streaming its
32 MB after them. Weights are written by no kernel, so o's programs may fetch them while
attention still runs if they are resident by then: the merge could let its successor in
before its own wait (a switch measured at 4efd59a, removed since), and each
program here (one or two an SM: 90-200 KB of shared memory) issues ``cp.async`` copies of
its first ``STAGED`` K chunks, then waits, reads ``x`` once into shared memory and reduces
chunk by chunk as the copies land; the chunks past ``STAGED`` are loaded after the wait
(their lines requested into L2 before it). Gluon, because Triton has no shared memory a
kernel can fill before a wait and read after it.

What it measured (H100, 2026-11-25): alone, over distinct weight copies and chained by
PDL, o 14.6-28.5 us against ``gemv``'s 13.7 (qkv 21.9-40.5 against 20.6): one or two
programs an SM stream slower than ``gemv``'s many; in the 36-layer graph 1.4-4 us a layer
slower than ``gemv`` in every configuration, with or without the early merge trigger,
4-warp attention (room beside it) or every kernel preferring the most shared memory.

One row only, 16-bit weights, ``K`` a multiple of ``CHUNK_K``; the float32 sum runs in
another order than ``gemv``'s (per-lane partial sums, then one reduction), rounded once.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from engine_core.kernels.pdl import pdl_args

# Triton 3.9 renamed these; the GPU machine's Triton (3.6) has the older names.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

CHUNK_K = 256  # 32 lanes x 8 elements (16 bytes, one cp.async each)


@gluon.jit
def _griddepcontrol(token, INSTRUCTION: gl.constexpr):
    """``griddepcontrol.wait`` or ``.launch_dependents`` once a thread (``token``: any
    scalar, so the asm is not elementwise over a tensor)."""
    gl.inline_asm_elementwise("griddepcontrol." + INSTRUCTION + "; mov.u32 $0, $1;", "=r,r",
                              [token], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_l2(addr, ok):
    """``kernels.pdl.prefetch_l2`` for Gluon, which cannot call a ``triton.jit`` function."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [addr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _staged_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn,
                        BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, STAGED: gl.constexpr,
                        TAIL: gl.constexpr, TOTAL: gl.constexpr, PREFETCH_TAIL: gl.constexpr,
                        USE_PDL: gl.constexpr):
    warps: gl.constexpr = gl.num_warps()
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [warps, 1], [1, 0])
    flat: gl.constexpr = gl.BlockedLayout([8], [32], [warps], [0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    plain_1d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = w_ptr.dtype.element_ty

    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile))
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, tile))
    row_ok = rows < N
    w_rows = w_ptr + rows.to(gl.int64)[:, None] * stride_wn + cols[None, :]
    ok = row_ok[:, None] & (cols < CHUNK)[None, :]
    staged = gl.allocate_shared_memory(dtype, [STAGED, BLOCK_N, CHUNK], plain)
    for c in gl.static_range(STAGED):
        _async_load(staged.index(c), w_rows + c * CHUNK, mask=ok)
        async_copy.commit_group()
    if PREFETCH_TAIL:
        for t in gl.static_range(TAIL):
            # One request a 128-byte line: lanes 0, 8, 16, 24 of each row's chunk.
            _prefetch_l2(w_rows + (STAGED + t) * CHUNK, ok & (cols % 64 == 0)[None, :])
    if USE_PDL:
        _griddepcontrol(gl.program_id(0), "wait")
        _griddepcontrol(gl.program_id(0), "launch_dependents")

    # x once into shared memory: one round trip instead of one a chunk.
    x_smem = gl.allocate_shared_memory(dtype, [TOTAL * CHUNK], plain_1d)
    ks = gl.arange(0, TOTAL * CHUNK, layout=flat)
    x_smem.store(gl.load(x_ptr + ks, mask=ks < K, other=0.0))
    _barrier()

    acc = gl.zeros([BLOCK_N, CHUNK], gl.float32, tile)
    for t in gl.static_range(TAIL):  # issued first: they come from L2 or HBM
        w = gl.load(w_rows + (STAGED + t) * CHUNK,
                    mask=ok & (((STAGED + t) * CHUNK + cols) < K)[None, :], other=0.0)
        x = x_smem.slice((STAGED + t) * CHUNK, CHUNK).load(gl.SliceLayout(0, tile))
        acc += w.to(gl.float32) * x.to(gl.float32)[None, :]
    for c in gl.static_range(STAGED):
        async_copy.wait_group(STAGED - 1 - c)
        w = staged.index(c).load(tile)
        x = x_smem.slice(c * CHUNK, CHUNK).load(gl.SliceLayout(0, tile))
        acc += w.to(gl.float32) * x.to(gl.float32)[None, :]
    y = gl.sum(acc, axis=1)
    gl.store(out_ptr + rows, y.to(dtype), mask=row_ok)


# Shared memory a program stages by default: 12 chunks of 32 rows (192 KB) leave room on
# an SM for a 4-warp decode-attention program (~23 KB) beside it.
BLOCK_N = 32
STAGED_CHUNKS = 12
NUM_WARPS = 4


def staged_gemv(x: torch.Tensor, weight: torch.Tensor, staged_chunks: int = STAGED_CHUNKS,
                block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                prefetch_tail: bool = True) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[1, K]``, ``weight`` ``[N, K]`` 16-bit and contiguous
    in K, ``K`` a multiple of ``CHUNK_K``."""
    m, k = x.shape
    n = weight.shape[0]
    assert m == 1 and weight.shape[1] == k and k % CHUNK_K == 0
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.element_size() == 2
    total = k // CHUNK_K
    staged = min(staged_chunks, total)
    assert staged >= 1, staged_chunks
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _staged_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, n, k, weight.stride(0), BLOCK_N=block_n, CHUNK=CHUNK_K,
        STAGED=staged, TAIL=total - staged, TOTAL=total, PREFETCH_TAIL=prefetch_tail,
        num_warps=num_warps, **pdl_args(x.device))
    return out
