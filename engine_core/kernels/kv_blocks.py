"""Copying whole KV blocks between the stacked paged cache and a contiguous buffer.

The stacked cache is ``[layers, 2, num_blocks, block_size, heads, head_dim]``; a buffer is
``[layers, 2, request_blocks, ...]``. Every (layer, K or V, block) is one contiguous chunk
of ``block_size * heads * head_dim`` elements, so the copy is a plain streaming copy of
chunks whose addresses come from a block-id list. ``torch.index_select``/``index_copy_``
on a middle dimension index element by element and reach ~30% of the copy rate on an H200
(``benchmarks/kv_gather.py``); this moves 16-byte words and runs near it. The chunks are
copied as integer words, so any cache dtype (fp8 included) is copied bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import as_int_words

TILE_BYTES = 4096  # bytes per program: 16 B per thread over 256 threads


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, block_ids_ptr, src_blocks, dst_blocks,
                        CHUNK: tl.constexpr, TILE: tl.constexpr, GATHER: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)  # (layer, K or V) within the run of layers
    j = tl.program_id(1)  # block within the request
    tile = tl.program_id(2)
    block = tl.load(block_ids_ptr + j).to(tl.int64)
    if GATHER:  # cache block -> buffer position j
        src_chunk, dst_chunk = plane * src_blocks + block, plane * dst_blocks + j
    else:  # buffer position j -> cache block
        src_chunk, dst_chunk = plane * src_blocks + j, plane * dst_blocks + block
    offsets = tile * TILE + tl.arange(0, TILE)
    mask = offsets < CHUNK
    words = tl.load(src_ptr + src_chunk * CHUNK + offsets, mask=mask)
    tl.store(dst_ptr + dst_chunk * CHUNK + offsets, words, mask=mask)


def _as_chunks(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[planes, blocks, chunk words]`` view of a contiguous ``[L, 2, blocks, ...]`` tensor."""
    planes, blocks = tensor.shape[0] * tensor.shape[1], tensor.shape[2]
    return as_int_words(tensor.view(torch.uint8).reshape(planes, blocks, -1), width)


def copy_blocks(source: torch.Tensor, dest: torch.Tensor, block_ids: torch.Tensor,
                gather: bool) -> None:
    """``gather``: ``dest[:, :, j] = source[:, :, block_ids[j]]``; else
    ``dest[:, :, block_ids[j]] = source[:, :, j]``. Both ``[L, 2, blocks, ...]``, contiguous,
    same dtype and block shape; ``block_ids`` int64 on the same device."""
    assert source.is_contiguous() and dest.is_contiguous() and source.dtype == dest.dtype
    assert source.shape[:2] == dest.shape[:2] and source.shape[3:] == dest.shape[3:]
    num_blocks = block_ids.numel()
    if num_blocks == 0:
        return
    assert num_blocks < 65536, "grid dimension y is limited to 65535 blocks"
    chunk_bytes = source[0, 0, 0].numel() * source.element_size()
    # The widest integer word dividing a chunk (Triton vectorises 8-byte words to 16 B).
    width = next(w for w in (8, 4, 2, 1) if chunk_bytes % w == 0)
    src, dst = _as_chunks(source, width), _as_chunks(dest, width)
    chunk = src.shape[2]
    tile = min(TILE_BYTES // width, triton.next_power_of_2(chunk))
    grid = (src.shape[0], num_blocks, triton.cdiv(chunk, tile))
    _copy_blocks_kernel[grid](src, dst, block_ids, src.shape[1], dst.shape[1],
                              CHUNK=chunk, TILE=tile, GATHER=gather,
                              num_warps=max(1, min(8, tile * width // 512)))
