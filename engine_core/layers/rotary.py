"""Rotary position embedding with HF's frequency schedules.

``inv_freq`` is computed with exactly the float32 operations HF uses so that float32
outputs match the reference bit for bit (any drift there compounds over layers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine_core.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def compute_inv_freq(head_dim: int, rope_theta: float,
                     rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32 on CPU for the given schedule.

    ``dynamic`` (NTK) equals the default schedule inside ``max_position_embeddings``, which
    is where HF evaluates it for sequences that fit; we do not rescale per batch beyond it
    (a batch-dependent frequency cannot be shared by the sequences of one step).
    """
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    # Explicit device: the loader builds models under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for a step's positions once; every layer then rotates q and k.

    ``use_triton`` (the Triton backend) computes them in one kernel on CUDA
    (``kernels.rotary.rope_cos_sin``: the same float32 math, one launch instead of six).
    """

    def __init__(self, head_dim: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None = None, use_triton: bool = False,
                 pdl: bool = True) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.use_triton = use_triton
        self.pdl = pdl  # the kernel launches with PDL (DeviceConfig.triton_pdl)
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope_theta, rope_scaling),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sin for positions ``[T]``, cast to ``dtype`` like HF."""
        if self.use_triton and positions.is_cuda:
            from engine_core.kernels.rotary import rope_cos_sin

            return rope_cos_sin(positions, self.inv_freq, dtype, pdl=self.pdl)
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` (the half-split layout HF checkpoints use)."""
        return x * cos + _rotate_half(x) * sin
