"""The decode kernel's work list for steps that mix prefills and decodes, built with numpy.

Why: a grid of ``sequences x splits`` takes one split count for every row, chosen from the
sequence count. A mixed CUDA graph pads its sequences (up to ``max_num_seqs``), so that count
collapses to one split and a long decode beside a prompt chunk was walked by one program per
KV head (Qwen3-8B on an H100, a 32k-token decode plus a 64-token prompt: 38 ms a step from the
graph against 25 ms eagerly). Here each decode row gets its own split count from its length
and the number of decode rows in the step, and the kernel launches one program per listed
(row, split) and KV head. A graph captures the longest list a step of its size can need;
unused entries are ``-1`` and their programs exit at once.

Layout (int32): ``items`` holds triples ``(sequence, split, splits of that row)``;
``rows`` holds per sequence ``(first item, splits)``, ``(0, 0)`` for rows that are not decodes,
which the split merge reads. As in the sequence grid, a decode row with ``seq_len`` 0 gets
zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# A split shorter than this costs more in the merge than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
# Most splits one row may have (the merge walks them in chunks; see paged_decode.py).
MAX_SPLITS = 64


class DecodeWork(NamedTuple):
    """A step's work list on the device: ``items`` (triples), how many programs to launch
    per KV head (a graph: the list's bound), ``rows`` (per-sequence first item, splits)."""

    items: torch.Tensor
    count: int
    rows: torch.Tensor


def max_decode_items(num_seqs: int, target_items: int) -> int:
    """The most work items a step of ``num_seqs`` sequences can list."""
    return num_seqs + target_items


def fill_decode_work(query_start_loc: np.ndarray, seq_lens: np.ndarray, target_items: int,
                     items: np.ndarray, rows: np.ndarray) -> int:
    """Write the work list of one step; the number of items.

    Each decode row (one new token) gets ``min(ceil(len / 256),
    ceil(target_items * len / total len))`` splits, at least 1 and at most 64: long rows
    share ``target_items`` programs a KV head (enough to fill the GPU about twice) in
    proportion to their lengths, and no split is shorter than it is worth.
    ``items`` must hold ``3 * max_decode_items`` entries, ``rows`` ``2 * num_seqs``.
    """
    q_lens = np.diff(query_start_loc)
    num_seqs = q_lens.shape[0]
    lengths = seq_lens[:num_seqs].astype(np.int64)
    decode = q_lens == 1  # a row with seq_len 0 gets one item, which writes zeros
    seqs = np.flatnonzero(decode)
    rows[:2 * num_seqs] = 0
    if seqs.size == 0:
        items[:] = -1
        return 0
    lens = lengths[seqs]
    by_length = -(-lens // MIN_TOKENS_PER_SPLIT)
    by_share = -(-target_items * lens // max(int(lens.sum()), 1))
    splits = np.clip(np.minimum(by_length, by_share), 1, MAX_SPLITS)
    count = int(splits.sum())
    if 3 * count > items.shape[0]:
        raise ValueError(f"{count} decode work items do not fit a list of {items.shape[0] // 3}")
    first = np.cumsum(splits) - splits
    owner = np.repeat(np.arange(seqs.size), splits)
    triples = items[:3 * count].reshape(count, 3)
    triples[:, 0] = seqs[owner]
    triples[:, 1] = np.arange(count) - first[owner]
    triples[:, 2] = splits[owner]
    items[3 * count:] = -1
    pairs = rows[:2 * num_seqs].reshape(num_seqs, 2)
    pairs[seqs, 0] = first
    pairs[seqs, 1] = splits
    return count


def decode_work(query_start_loc: list[int], seq_lens: list[int], target_items: int,
                device: torch.device) -> DecodeWork:
    """The work list of a step given as host lists, on ``device``."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    num_seqs = starts.shape[0] - 1
    items = np.empty(3 * max(max_decode_items(num_seqs, target_items), 1), dtype=np.int32)
    rows = np.empty(2 * max(num_seqs, 1), dtype=np.int32)
    count = fill_decode_work(starts, np.asarray(seq_lens, dtype=np.int64), target_items,
                             items, rows)
    return DecodeWork(torch.from_numpy(items).to(device), count,
                      torch.from_numpy(rows).to(device))
