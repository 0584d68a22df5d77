"""The description of a norm computed inside the projection after it (no triton import:
the model code builds it on any install; the kernels are in ``rms_norm.py``, ``gemv.py``
and ``split_k_mlp.py``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class FoldedNorm(NamedTuple):
    """A norm computed inside the projection after it: that projection's input ``x`` is
    already the residual sum, and ``sum_squares`` (float32 ``[rows]``) its rows' sums of
    squares, accumulated by the projection that produced it (``gemv(sum_squares=...)``);
    ``weight`` and ``eps`` are the norm's."""

    weight: torch.Tensor
    eps: float
    sum_squares: torch.Tensor


def check_folded_norm(norm: FoldedNorm, x: torch.Tensor, projection_weight: torch.Tensor) -> None:
    """Shapes, dtypes and layouts the folded-norm kernels take."""
    weight, _, sums = norm
    assert weight.dtype == x.dtype == projection_weight.dtype
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    assert sums.dtype == torch.float32 and sums.shape == (x.shape[0],) and sums.is_contiguous()
