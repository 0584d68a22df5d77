"""Triton kernels for the CUDA fast path (paged KV write, paged attention, RMSNorm, RoPE).

Importing this package never imports triton: CPU-only installs (and CI) import the engine
without it. The kernel modules import triton at their top and are imported lazily, only
by code that has already chosen the Triton path.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` can work, decided without importing it."""
    return importlib.util.find_spec("triton") is not None


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tile widths must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


def as_int_words(tensor: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The same memory as integers of ``width`` bytes (default: the element width), so a
    copy through it is bit-exact for any dtype (fp8 included)."""
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        width or tensor.element_size()]
    return tensor.view(dtype)
