"""The prefill kernel's work list: the query tiles of a step, built on the host with numpy.

Why a list: launching one program per (sequence, tile) slot of a ``num_seqs x
max_query_len`` grid wastes programs on uneven batches and needs the host's longest query,
which a CUDA graph cannot follow from step to step. A list of ``(sequence, first token)``
pairs is built with the step's other inputs; a graph captures the longest list a step of
its size can need and a shorter one ends in ``-1`` pairs, whose programs exit at once.
Numpy only (no Triton import): step inputs are built on every device.
"""

from __future__ import annotations

import numpy as np
import torch


def max_prefill_tiles(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """The most query tiles ``num_tokens`` tokens in ``num_seqs`` sequences can make."""
    return -(-num_tokens // tile_tokens) + num_seqs


def fill_prefill_tiles(query_start_loc: np.ndarray, tile_tokens: int, out: np.ndarray,
                       include_single: bool = False) -> int:
    """Write the query tiles of a step into ``out`` (int32, pairs ``sequence, first token``
    of the tile within the sequence's new tokens), ``-1`` after the last; their count.

    Sequences of one new token have no tile unless ``include_single`` (the decode kernel
    owns them in a paged step); empty ones (graph padding) never have one.
    """
    q_lens = np.diff(query_start_loc)
    tiles = -(-q_lens // tile_tokens)
    if not include_single:
        tiles[q_lens == 1] = 0
    count = int(tiles.sum())
    if 2 * count > out.shape[0]:
        raise ValueError(f"{count} query tiles do not fit a list of {out.shape[0] // 2}")
    seqs = np.repeat(np.arange(q_lens.shape[0], dtype=np.int32), tiles)
    first_tile = np.cumsum(tiles) - tiles
    pairs = out[:2 * count].reshape(count, 2)
    pairs[:, 0] = seqs
    pairs[:, 1] = (np.arange(count) - first_tile[seqs]) * tile_tokens
    out[2 * count:] = -1
    return count


def prefill_tiles(query_start_loc: list[int], tile_tokens: int, device: torch.device,
                  include_single: bool = False) -> tuple[torch.Tensor, int]:
    """The tile list of a step given as host lists, on ``device``; (tiles, count)."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    num_seqs = starts.shape[0] - 1
    out = np.empty(2 * max(max_prefill_tiles(int(starts[-1]), num_seqs, tile_tokens), 1),
                   dtype=np.int32)
    count = fill_prefill_tiles(starts, tile_tokens, out, include_single)
    return torch.from_numpy(out).to(device), count
