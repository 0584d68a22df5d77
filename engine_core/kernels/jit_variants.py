"""How many Triton kernel variants this process has compiled, per kernel.

Why: a variant compiled while serving stalls every request behind it (about a second on an
H200). The engine logs the count after its warm-up, and a GPU test asserts that a varied
workload adds none; only the kernel modules already imported are looked at, so this never
imports triton itself.
"""

from __future__ import annotations

import sys
from typing import Any

KERNEL_PACKAGE = "engine_core.kernels."


def _jit_functions() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(KERNEL_PACKAGE) or module is None:
            continue
        for attr, value in vars(module).items():
            if hasattr(value, "device_caches") and hasattr(value, "fn"):
                found[f"{name.removeprefix(KERNEL_PACKAGE)}.{attr}"] = value
    return found


def compiled_variants() -> dict[str, int]:
    """``module.kernel`` -> variants compiled so far (over all devices)."""
    counts: dict[str, int] = {}
    for name, fn in _jit_functions().items():
        # device_caches: device -> (kernel cache, ...); the tuple's length differs between
        # Triton releases, its first item is the compiled-kernel dict in all of them.
        total = sum(len(entry[0]) for entry in fn.device_caches.values())
        if total:
            counts[name] = total
    return counts
