"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of the fused gate/up output ``[T, 2 * I]`` (gate columns first).

    ``use_triton`` (the Triton fast path) runs one fused kernel on CUDA tensors of a 16-bit
    dtype; float32 keeps torch's two kernels, whose ``exp`` HF shares bit for bit. ``pdl``:
    launch it with PDL (``DeviceConfig.triton_pdl``).
    """

    def __init__(self, use_triton: bool = False, pdl: bool = True) -> None:
        super().__init__()
        self.use_triton = use_triton
        self.pdl = pdl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from engine_core.kernels.silu_mul import silu_and_mul

            return silu_and_mul(x, pdl=self.pdl)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
