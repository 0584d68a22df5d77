"""Fused RMSNorm (optionally after the residual add), one program per row.

Unfused, torch runs about eight elementwise and reduction kernels per norm (plus the
residual add), each a round trip through memory; on a decode step those launches are
most of the norm's cost. The arithmetic follows the torch layer step by step, with the
same roundings, so float32 outputs match to the last bits of the mean and bf16 outputs
match the reference's bf16 roundings:
``sum = round(x + residual)``; ``y = round(sum * rsqrt(mean(sum^2) + eps))``;
``out = round(weight * y)``.

``x`` may be a float32 accumulator of a split-K projection (``split_k_mlp``) with a 16-bit
residual: it is rounded to the residual's dtype first, where the unsplit projection
rounds its output. ``clear`` zeroes such an accumulator for the projection that follows
the norm, so that no memset node (which PDL cannot chain) enters the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, clear_ptr,
                     stride_x, stride_r, stride_o, stride_ro, stride_c, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CLEAR: tl.constexpr,
                     USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight before the wait: no kernel writes it, so under PDL its round trip
    # overlaps the predecessor's tail instead of following the reduction (kernels/pdl.py).
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_for_predecessor(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if CLEAR:
        tl.store(clear_ptr + row * stride_c + cols, tl.zeros([BLOCK], tl.float32), mask=mask)
    if HAS_RESIDUAL:
        dtype = residual_ptr.dtype.element_ty
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    else:
        dtype = x_ptr.dtype.element_ty
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / n_cols
    y = (x32 * tl.rsqrt(variance + eps)).to(dtype)
    out = weight.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, cols]`` view with unit column stride (copying if needed)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             clear: torch.Tensor | None = None,
             pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight * norm(x + residual), x + residual)``; without a residual the second is None.

    The sum is rounded to the residual's dtype before the norm, as ``x + residual`` in
    torch is (a float32 ``x``, a split-K accumulator, is rounded to it first). ``clear``:
    a float32 ``[rows, cols]`` buffer (not ``x``) set to zero, for a split-K projection
    after the norm. ``pdl``: launch with PDL where the device has it (``pdl.pdl_args``).
    """
    n_cols = x.shape[-1]
    x2 = _rows(x)
    model_dtype = x.dtype if residual is None else residual.dtype
    out_dtype = torch.promote_types(weight.dtype, model_dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    residual_out = None
    r2 = ro2 = x2  # placeholders when there is no residual
    if residual is not None:
        r2 = _rows(residual)
        residual_out = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
        ro2 = residual_out
    c2 = x2  # placeholder when there is nothing to clear
    if clear is not None:
        assert clear.dtype == torch.float32 and clear.shape == x2.shape and clear.stride(1) == 1
        # Not the input: a thread's zero store may land before another's load of it.
        assert clear.data_ptr() != x2.data_ptr(), "clear must not alias x"
        c2 = clear
    block = next_power_of_2(n_cols)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, ro2, c2, x2.stride(0), r2.stride(0), out.stride(0),
            ro2.stride(0), c2.stride(0), n_cols, eps, BLOCK=block,
            HAS_RESIDUAL=residual is not None, CLEAR=clear is not None,
            num_warps=min(max(block // 512, 1), 16), enable_fp_fusion=False,
            **pdl_args(x.device, pdl))
    out = out.view(*x.shape[:-1], n_cols)
    if residual_out is not None:
        residual_out = residual_out.view(residual.shape)
    return out, residual_out
