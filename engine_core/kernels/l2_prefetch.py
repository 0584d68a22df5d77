"""Pull a weight into the L2 cache while the GPU's memory bandwidth would otherwise idle.

Why: a decode step at batch 1 alternates weight-streaming GEMVs (bandwidth-bound) with
latency-bound stretches (RoPE, the KV write, decode attention and its merge: ~12 us a layer
on an H200 during which HBM is nearly idle). Prefetching the next projection's weight into
L2 at the start of such a stretch lets that projection read from L2 instead of HBM.

One kernel issues Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``: one
instruction per ``CHUNK`` bytes, fire and forget) for the whole tensor, and only then waits
for its predecessor (PDL): the prefetches are weights, which no kernel of a step writes,
so they may start while the predecessor runs; the wait keeps the chain's ordering (this
kernel completes only after its predecessor). Hopper or newer only (``supported``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

CHUNK = 1 << 16  # bytes per prefetch instruction
CHUNKS_PER_PROGRAM = 32


@triton.jit
def _l2_prefetch_kernel(ptr, n_bytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                        USE_PDL: tl.constexpr):
    idx = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    start = idx.to(tl.int64) * CHUNK
    ok = start < n_bytes
    # Whole 16-byte units only (the instruction's granularity); the hint may miss a tail.
    size = (tl.minimum(n_bytes - start, CHUNK) // 16 * 16).to(tl.int32)
    ok = ok & (size > 0)
    ptrs = ptr + tl.where(ok, start, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, tl.where(ok, size, 16), ok.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)
    wait_for_predecessor(USE_PDL)


def supported(device: torch.device) -> bool:
    """Bulk prefetch needs sm_90 or newer (and a real GPU, not the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """Start pulling the first ``max_bytes`` (default: all) of ``t``'s storage into L2."""
    assert t.is_contiguous()
    n_bytes = t.numel() * t.element_size()
    if max_bytes is not None:
        n_bytes = min(n_bytes, max_bytes)
    if n_bytes == 0:
        return
    grid = (triton.cdiv(triton.cdiv(n_bytes, CHUNK), CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), n_bytes, CHUNK=CHUNK,
                              CHUNKS=CHUNKS_PER_PROGRAM, num_warps=1, **pdl_args(t.device))
