"""Dense projection layer.

A thin module of our own (rather than ``nn.Linear``) so that tensor-parallel variants
can later shard ``weight`` along a named dimension without touching the model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.kernels.gemv_tilings import TUNED_TILINGS

_GEMV_DTYPES = (torch.bfloat16, torch.float16)
# Weights up to this many elements (256 MiB in 16 bits) take the Triton GEMV. On an H200, at
# one row and with each shape's tiling (kernels/gemv.py), it beat or tied cuBLAS on every
# Qwen3-0.6B and Qwen3-8B projection from 4 to 201 MB (the 8B's fused gate/up: 48.4 vs
# 49.5 us; the 0.6B's 4 MB o_proj: 4.5 vs 12.8); larger layer weights (a 70B's MLP) stay
# with cuBLAS unless their shape has a measured tiling (``gemv_tilings.TUNED_TILINGS``:
# Llama-3.1-70B's TP=2 gate/up, 470 MB, 108.5 us against cuBLAS's 119.8). The LM head has
# its own rule (layers/embedding.py).
GEMV_MAX_WEIGHT_ELEMENTS = 128 << 20


def gemv_sized(in_features: int, out_features: int) -> bool:
    """Whether a projection's weight is small enough for the Triton GEMV (and split-K), or
    of a shape whose GEMV tiling was measured."""
    return (in_features * out_features <= GEMV_MAX_WEIGHT_ELEMENTS
            or (out_features, in_features) in TUNED_TILINGS)


def takes_gemv(x: torch.Tensor, max_rows: int) -> bool:
    """Whether a projection of ``x`` goes to the Triton GEMV: at most ``max_rows`` rows of a
    16-bit CUDA input (shapes, dtype and device only, so a CUDA graph records one choice)."""
    return (0 < x.shape[0] <= max_rows and x.dim() == 2 and x.is_cuda
            and x.dtype in _GEMV_DTYPES and x.stride(1) == 1)


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; ``weight`` is ``[out_features, in_features]`` as in HF.

    ``transposed``: ``weight`` is that shape's view of ``[in_features, out_features]``
    storage (each input's column of W contiguous), for kernels that stream W by input
    slices (``kernels/split_k_mlp.py``); loading fills it by name as any weight, and
    cuBLAS takes either layout.

    ``gemv_max_rows`` > 0 (the Triton path) sends inputs of at most that many rows with
    16-bit CUDA weights to the Triton GEMV when the weight is small enough
    (``GEMV_MAX_WEIGHT_ELEMENTS``); the choice depends on shapes only, so a CUDA graph of a
    decode batch records one or the other for good; ``pdl`` launches it with PDL
    (``DeviceConfig.triton_pdl``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gemv_max_rows: int = 0, transposed: bool = False, pdl: bool = True) -> None:
        super().__init__()
        self.pdl = pdl
        self.in_features = in_features
        self.out_features = out_features
        small = gemv_sized(in_features, out_features)
        # The GEMV streams rows of W, so a transposed weight never takes it.
        self.gemv_max_rows = gemv_max_rows if small and not transposed else 0
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        weight = torch.empty(shape)
        self.weight = nn.Parameter(weight.t() if transposed else weight, requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs the Triton GEMV (shapes, dtype and device only)."""
        return takes_gemv(x, self.gemv_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_gemv(x):
            from engine_core.kernels.gemv import gemv

            return gemv(x, self.weight, self.bias, pdl=self.pdl)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked row-wise into one weight.

    Why: at decode a projection is a weight-streaming GEMV whose cost is its bytes plus a
    fixed launch and tail; q/k/v (and gate/up) as one matrix are one launch and one larger,
    more efficient GEMV instead of three (two) small ones. Checkpoints keep the parts
    apart: ``part_names[i]`` is the checkpoint module whose tensors fill rows
    ``part_slice(i)``; ``split`` cuts an output back into the parts (views, no copy).
    """

    def __init__(self, in_features: int, output_sizes: tuple[int, ...],
                 part_names: tuple[str, ...], bias: bool = False,
                 gemv_max_rows: int = 0, pdl: bool = True) -> None:
        if len(output_sizes) != len(part_names):
            raise ValueError("one part name per output size")
        super().__init__(in_features, sum(output_sizes), bias, gemv_max_rows, pdl=pdl)
        self.output_sizes = tuple(output_sizes)
        self.part_names = tuple(part_names)

    def part_slice(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.output_sizes, dim=-1))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, parts={dict(zip(self.part_names, self.output_sizes))}, "
                f"bias={self.bias is not None}")
