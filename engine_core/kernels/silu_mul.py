"""``silu(gate) * up`` over the fused gate/up projection's output in one launch.

torch runs it as two kernels (the SiLU, then the product) with a round trip of the
intermediate through memory; at decode each is a few microseconds of launch-bound work per
layer. The arithmetic rounds where torch rounds: ``out = round(round(silu(g)) * u)`` in the
model dtype, SiLU computed in float32 as ``g / (1 + exp(-g))``. ``exp`` here is the GPU's
fast exponential, which can differ from torch's in the last float32 bit; rounded to a
16-bit dtype that is invisible except at rare rounding ties, so the model uses this
kernel for 16-bit dtypes only and keeps torch (bit-identical to HF) for float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels.pdl import pdl_args, wait_for_predecessor

BLOCK = 1024


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """``round(round(silu(gate)) * up)`` in ``dtype`` from float32 ``gate``/``up`` holding
    ``dtype`` values: the rounding rule of this kernel and of the GEMV's SiLU epilogue."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, silu_times_up(gate, up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """``[T, 2 * I]`` (gate columns, then up columns) -> ``[T, I]``; ``pdl`` as
    ``pdl.pdl_args``."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(n_cols, BLOCK))](
            x, out, x.stride(0), out.stride(0), n_cols, BLOCK=BLOCK, num_warps=4,
            enable_fp_fusion=False, **pdl_args(x.device, pdl))
    return out
