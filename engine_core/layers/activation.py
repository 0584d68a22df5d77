"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up``: the MLP's activation, kept separate so a fused kernel can replace it."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up
