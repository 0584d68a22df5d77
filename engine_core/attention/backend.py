"""The one attention interface every backend implements, and backend selection."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine_core.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention: store this step's K/V in the cache, then attend over the cache.

    ``kv_cache`` is one layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    tensor (0 = K, 1 = V); its dtype may differ from q's (fp8 cache): values are cast on
    write and cast back on read. ``kv_cache=None`` (a profiling run with no cache yet)
    attends over the new tokens only, which requires every sequence to be a full prefill.
    """

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> attention output ``[T, Hq, D]``."""


def get_attention_backend(device: str, kv_cache_dtype: str | torch.dtype | None = None
                          ) -> AttentionBackend:
    """Pick the backend for a device and cache dtype.

    Only the torch reference exists today; it serves CPU and GPU and every cache dtype.
    A Triton backend for CUDA slots in here.
    """
    from engine_core.attention.torch_ref import TorchRefAttentionBackend

    del device, kv_cache_dtype  # the reference handles all of them
    return TorchRefAttentionBackend()
