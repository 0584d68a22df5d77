"""A kernel that only requests lines of a weight into L2, for the layer graph's side-stream
prefetch variants (benchmarks/decode_kernels.py): at batch 1 HBM idles during decode
attention, and o's first columns could be in L2 by the time o reads them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels.pdl import prefetch_l2


@triton.jit
def _prefetch_columns_kernel(w_ptr, N, stride_wn, LINES: tl.constexpr, LINE: tl.constexpr,
                             ROWS: tl.constexpr):
    # Program p takes rows p, p + P, ... in tiles of ROWS rows, LINES lines each.
    lines = tl.arange(0, LINES) * LINE
    for r0 in range(tl.program_id(0) * ROWS, N, tl.num_programs(0) * ROWS):
        rows = r0 + tl.arange(0, ROWS)
        addr = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + lines[None, :]
        prefetch_l2(addr, (rows < N)[:, None] & (lines >= 0)[None, :])


def prefetch_columns(w: torch.Tensor, columns: int, programs: int) -> None:
    """The first ``columns`` (a power-of-two multiple of a 128-byte line) of each row of the
    row-major ``w`` requested into L2 by ``programs`` programs."""
    line = 128 // w.element_size()
    lines = columns // line
    assert w.stride(1) == 1 and lines * line == columns and lines & (lines - 1) == 0
    _prefetch_columns_kernel[(programs,)](w, w.shape[0], w.stride(0), LINES=lines, LINE=line,
                                          ROWS=max(1, 4096 // lines), num_warps=8)
