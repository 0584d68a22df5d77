"""Triton kernels for the CUDA fast path (paged KV write, paged attention, RMSNorm, RoPE).

Importing this package never imports triton: CPU-only installs (and CI) import the engine
without it. The kernel modules import triton at their top and are imported lazily, only
by code that has already chosen the Triton path.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` can work, decided without importing it."""
    return importlib.util.find_spec("triton") is not None


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tile widths must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()
