"""Paged KV blocks of many layers <-> one contiguous buffer, one kernel each way.

The engine allocates every layer's cache as one tensor (``allocate_kv_caches``), so the
layers seen together are ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.
Wire layout of a run of layers: ``[layers, 2, request_blocks, block_size, heads, head_dim]``
(kv-major, the cache's own order), so one launch gathers any run of layers of a request and
one scatters all of them: never a loop per block or per layer. On CUDA both are
the chunk-copy kernel of ``engine_core.kernels.kv_blocks`` (near the copy rate); on CPU
``index_select``/``index_copy_``. Both copy integer words, so every cache dtype (fp8
included) arrives bit for bit. Between tensor-parallel layouts a rank moves a ``HeadSlice``
of each block: the wire buffer then holds only those heads,
``[layers, 2, request_blocks, block_size, slice_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from engine_core.errors import KVTransferError
from engine_core.kernels import as_int_words
from engine_core.parallel.kv_layout import HeadSlice


def stack_layers(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """The per-layer caches as one ``[layers, 2, blocks, ...]`` view (no copy).

    They must be equally spaced slices of one allocation, as ``allocate_kv_caches`` makes
    them; anything else is a configuration error, not something to copy around.
    """
    first = kv_caches[0]
    if not first.is_contiguous():
        raise KVTransferError("kv caches must be contiguous")
    step = first.numel()
    for layer, cache in enumerate(kv_caches):
        same_memory = (cache.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                       and cache.storage_offset() == first.storage_offset() + layer * step)
        if cache.shape != first.shape or cache.dtype != first.dtype or not same_memory:
            raise KVTransferError("kv caches must be consecutive layers of one allocation "
                                  "(allocate_kv_caches)")
    return first.as_strided((len(kv_caches), *first.shape), (step, *first.stride()))


def gather_layers(stacked: torch.Tensor, first: int, end: int, block_ids: torch.Tensor,
                  out: torch.Tensor, heads: HeadSlice | None = None) -> torch.Tensor:
    """K and V of ``block_ids`` in layers ``[first, end)`` into ``out`` (wire layout); with
    ``heads``, only those KV heads of each block (a transfer between tensor-parallel layouts)."""
    if heads is not None and not heads.is_whole(stacked):
        torch.index_select(as_int_words(heads.of(stacked[first:end])), 2, block_ids,
                           out=as_int_words(out))
    elif stacked.is_cuda:
        from engine_core.kernels.kv_blocks import copy_blocks  # imports triton

        copy_blocks(stacked[first:end], out, block_ids, None)
    else:
        torch.index_select(as_int_words(stacked[first:end]), 2, block_ids, out=as_int_words(out))
    return out


def scatter_layers(stacked: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor,
                   first: int = 0, heads: HeadSlice | None = None) -> None:
    """Write a wire-layout buffer of layers ``[first, first + len(buffer))`` into
    ``block_ids`` of the paged cache; with ``heads``, into only those KV heads of each block
    (the others keep what other senders wrote)."""
    layers = stacked[first:first + buffer.shape[0]]
    if heads is not None and not heads.is_whole(stacked):
        as_int_words(heads.of(layers)).index_copy_(2, block_ids, as_int_words(buffer))
    elif stacked.is_cuda:
        from engine_core.kernels.kv_blocks import copy_blocks  # imports triton

        copy_blocks(buffer, layers, None, block_ids)
    else:
        as_int_words(layers).index_copy_(2, block_ids, as_int_words(buffer))


def copy_indexed_blocks(source: torch.Tensor, dest: torch.Tensor, src_ids: torch.Tensor,
                        dst_ids: torch.Tensor) -> None:
    """``dest[:, :, dst_ids[j]] = source[:, :, src_ids[j]]`` for every layer: between the
    device cache and KV offload's host slots. With a CUDA side it is one kernel that reads or
    writes the pinned host side in place (ids on the device); on CPU index_select/index_copy_
    (ids on the CPU)."""
    if source.is_cuda or dest.is_cuda:
        from engine_core.kernels.kv_blocks import copy_blocks  # imports triton

        copy_blocks(source, dest, src_ids, dst_ids)
    else:
        as_int_words(dest).index_copy_(2, dst_ids,
                                       as_int_words(source).index_select(2, src_ids))


def block_ids_tensor(block_ids: list[int], device: torch.device | str) -> torch.Tensor:
    """Block ids as an int64 index tensor on ``device`` (one host-to-device copy)."""
    return torch.tensor(block_ids, dtype=torch.int64).to(device, non_blocking=True)


def wire_shape(num_layers: int, num_blocks: int, block_shape: list[int]) -> tuple[int, ...]:
    """Shape of a buffer holding ``num_blocks`` blocks of ``num_layers`` layers."""
    return (num_layers, 2, num_blocks, *block_shape)
