"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels.

Why: in a decode graph most kernels run for a few microseconds, and each one's blocks are
only scheduled once its predecessor has finished. Launched with PDL, a kernel's blocks are
scheduled while the predecessor drains and park at ``griddepcontrol.wait``, which returns
once the predecessor has completed and its writes are visible: the launch gap is hidden.

Rule for every kernel that takes part: call ``wait_for_predecessor`` first thing, before
any store; loads (or L2 prefetches) may come first only for what the predecessor does not
write, and an early return only where the kernel stores nothing. Why that is safe: a
kernel's blocks start once every block of its predecessor has passed its own wait, so the
kernel two back has completed, and a predecessor stores nothing before its wait. Weights
qualify (no kernel writes them), and so do, for batch-1 decode attention after the qkv
GEMV, the step's inputs and the cache's older positions. Then a kernel's completion implies
its predecessor's, so the chain is ordered exactly as without PDL (kernels launched without
PDL, cuBLAS for instance, keep ordinary stream order on both sides). On Hopper and newer
GPUs only; never under the Triton interpreter; ``DeviceConfig.triton_pdl`` turns it off
(False under ``PDSERVE_TRITON_PDL=0`` or ``TRITON_INTERPRET=1``, read at the entry points).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr = True):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH_DEPENDENTS:
            # Let the next kernel's blocks be scheduled as soon as this grid's last ones
            # run. Triggering before the wait instead (so that whole chains of kernels get
            # scheduled and park) measured 27% slower on Qwen3-8B layers at batch 1 (H200):
            # the parked blocks crowd the running kernel's SMs.
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """The trigger alone, for kernels that wait with ``LAUNCH_DEPENDENTS=False`` and let
    their successor in later (after their main loop)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(addr, ok):
    """Request the 128-byte lines at ``addr`` (where ``ok``) into L2: fire and forget, no
    registers held and nothing waits, so it may precede ``wait_for_predecessor`` for what
    the predecessor does not write."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _supported(device_index: int) -> bool:
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(device: torch.device, enabled: bool = True) -> dict[str, Any]:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr, on ``device``: PDL when
    ``enabled`` (``DeviceConfig.triton_pdl``) and the device has it."""
    if not enabled or device.type != "cuda":
        return {"USE_PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _supported(index):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
