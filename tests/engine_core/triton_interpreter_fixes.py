"""Test-only fixes for two Triton 3.6 interpreter bugs that the compiled kernels never meet.

- Scalars are 1-element arrays converted with ``int(array)``, which NumPy 2.3+ refuses, so
  a loop with tensor bounds (``range(lo, hi, BLOCK)``) fails under the interpreter.
- bfloat16 values are held as their uint16 bits and ``tl.dot`` multiplies those bits.
  Widening bf16 operands to float32 (exact) gives what the GPU's fp32-accumulating dot
  computes.
- float32 -> bfloat16 casts truncate; GPUs (and torch) round to nearest even.

(fp8 downcasts are wrong too, in rounding and in a dropped carry; the tests check fp8
writes on CUDA only instead of re-implementing the conversion here.)

``apply()`` is idempotent and only touches the interpreter module.
"""

from __future__ import annotations

import numpy as np


def apply() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_pdserve_fixed", False):
        return
    interpreter._pdserve_fixed = True
    _fix_scalar_index(interpreter)
    _fix_bf16_dot(interpreter)
    _fix_bf16_rounding(interpreter)


def _fix_scalar_index(interpreter) -> None:
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


def _fix_bf16_dot(interpreter) -> None:
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def _fix_bf16_rounding(interpreter) -> None:
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
            return interpreter.TensorHandle((rounded >> np.uint32(16)).astype(np.uint16),
                                            dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
