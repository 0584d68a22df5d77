"""RMSNorm, computed in float32 like HF so low-precision models match the reference."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (Llama, Qwen2, Qwen3 q/k norms).

    ``use_triton`` (set when the Triton attention backend is chosen) runs the fused kernel
    for CUDA tensors; it rounds where this module's torch code rounds, and launches with
    PDL when ``pdl`` (``DeviceConfig.triton_pdl``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, use_triton: bool = False,
                 pdl: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = use_triton
        self.pdl = pdl
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _triton(self, x: torch.Tensor) -> bool:
        return self.use_triton and x.is_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton(x):
            from engine_core.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, pdl=self.pdl)[0]
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        # HF casts back before the weight multiply; doing the same keeps bf16 outputs identical.
        return self.weight * x32.to(input_dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     clear: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the pre-norm block's residual step, fused.

        On the Triton path ``x`` may be a split-K projection's float32 accumulator (rounded
        to the residual's dtype first) and ``clear`` a float32 buffer to zero for the next
        one (``kernels/rms_norm.py``).
        """
        if self._triton(x):
            from engine_core.kernels.rms_norm import rms_norm

            out, summed = rms_norm(x, self.weight, self.eps, residual, clear, pdl=self.pdl)
            assert summed is not None
            return out, summed
        assert clear is None, "clear is for the Triton path's split-K accumulators"
        assert x.dtype == residual.dtype, "a float32 accumulator is for the Triton path"
        summed = x + residual
        return self.forward(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, use_triton={self.use_triton}"
