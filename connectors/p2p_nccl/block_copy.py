"""Paged KV blocks <-> one contiguous buffer per layer.

Wire layout of one layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (block
major), so skipping leading blocks the peer already has is a contiguous slice. One
``index_select`` gathers and one ``index_copy_`` scatters a layer: never a loop per block.
"""

from __future__ import annotations

import torch


def block_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """View ``[2, num_blocks, ...]`` as ``[num_blocks, 2, ...]`` (no copy)."""
    return kv_cache.transpose(0, 1)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of ``block_ids`` of one layer, as one contiguous block-major tensor."""
    source = block_major(kv_cache)
    if out is None:
        return torch.index_select(source, 0, block_ids)
    return torch.index_select(source, 0, block_ids, out=out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write a block-major buffer into ``block_ids`` of one layer's paged cache, in place."""
    block_major(kv_cache).index_copy_(0, block_ids, buffer)


def block_ids_tensor(block_ids: list[int], device: torch.device | str) -> torch.Tensor:
    """Block ids as an int64 index tensor on ``device`` (one host-to-device copy)."""
    return torch.tensor(block_ids, dtype=torch.int64).to(device, non_blocking=True)


def wire_shape(num_blocks: int, kv_cache: torch.Tensor) -> tuple[int, ...]:
    """Shape of one layer's buffer for ``num_blocks`` blocks of this cache."""
    return (num_blocks, 2, *kv_cache.shape[2:])
