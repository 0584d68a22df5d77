"""Copying whole KV blocks between the stacked paged cache and a contiguous buffer (the
connector) or the host slots of KV offload.

The stacked cache is ``[layers, 2, num_blocks, block_size, heads, head_dim]``; a buffer is
``[layers, 2, request_blocks, ...]``. Every (layer, K or V, block) is one contiguous chunk
of ``block_size * heads * head_dim`` elements, so the copy is a plain streaming copy of
chunks whose addresses come from block-id lists. ``torch.index_select``/``index_copy_``
on a middle dimension index element by element and reach ~30% of the copy rate on an H200
(``experiments/kv_gather.py``); this moves 16-byte words and runs near it. The chunks are
copied as integer words, so any cache dtype (fp8 included) is copied bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import as_int_words

TILE_BYTES = 4096  # bytes per program: 16 B per thread over 256 threads


# The block counts vary per call; specialising on them (divisible by 16, equal to 1) would
# compile a new variant on a request's first odd-sized transfer, inside a step.
@triton.jit(do_not_specialize=["src_blocks", "dst_blocks"])
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_blocks, dst_blocks,
                        CHUNK: tl.constexpr, TILE: tl.constexpr,
                        SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)  # (layer, K or V) within the run of layers
    j = tl.program_id(1).to(tl.int64)  # position in the id lists
    tile = tl.program_id(2)
    src_block = j
    dst_block = j
    if SRC_INDEXED:
        src_block = tl.load(src_ids_ptr + j).to(tl.int64)
    if DST_INDEXED:
        dst_block = tl.load(dst_ids_ptr + j).to(tl.int64)
    src_chunk = plane * src_blocks + src_block
    dst_chunk = plane * dst_blocks + dst_block
    offsets = tile * TILE + tl.arange(0, TILE)
    mask = offsets < CHUNK
    words = tl.load(src_ptr + src_chunk * CHUNK + offsets, mask=mask)
    tl.store(dst_ptr + dst_chunk * CHUNK + offsets, words, mask=mask)


def _as_chunks(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[planes, blocks, chunk words]`` view of a contiguous ``[L, 2, blocks, ...]`` tensor."""
    planes, blocks = tensor.shape[0] * tensor.shape[1], tensor.shape[2]
    return as_int_words(tensor.view(torch.uint8).reshape(planes, blocks, -1), width)


def copy_blocks(source: torch.Tensor, dest: torch.Tensor, src_ids: torch.Tensor | None,
                dst_ids: torch.Tensor | None) -> None:
    """``dest[:, :, dst_ids[j]] = source[:, :, src_ids[j]]`` for every j; a missing id list
    means position j itself (``src_ids`` only: a gather into a buffer; ``dst_ids`` only: a
    scatter from one; both: block to block, e.g. device cache <-> host slots).

    Both ``[L, 2, blocks, ...]``, contiguous, same dtype and block shape; the id lists int64
    on the device. Either tensor may be pinned host memory (the GPU reads or writes it over
    the bus through its mapped address: one kernel, no staging copy).
    """
    assert source.is_contiguous() and dest.is_contiguous() and source.dtype == dest.dtype
    assert source.shape[:2] == dest.shape[:2] and source.shape[3:] == dest.shape[3:]
    assert src_ids is not None or dst_ids is not None
    ids = src_ids if src_ids is not None else dst_ids
    assert dst_ids is None or src_ids is None or dst_ids.numel() == ids.numel()
    num_blocks = ids.numel()
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
    _copy_blocks_kernel[grid](src, dst, ids if src_ids is None else src_ids,
                              ids if dst_ids is None else dst_ids, src.shape[1], dst.shape[1],
                              CHUNK=chunk, TILE=tile, SRC_INDEXED=src_ids is not None,
                              DST_INDEXED=dst_ids is not None,
                              num_warps=max(1, min(8, tile * width // 512)))
