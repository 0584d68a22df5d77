"""The prefill kernel's work list: every query token in exactly one tile of its sequence,
decode rows and empty (padding) sequences in none, the bound never exceeded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.attention.prefill_tiles import (
    fill_prefill_tiles,
    max_prefill_tiles,
    prefill_tiles,
)


def covered_tokens(pairs: np.ndarray, starts: np.ndarray, tile: int) -> list[int]:
    """Flat token indices the tiles cover (clipped to each sequence's new tokens)."""
    tokens = []
    for seq, first in pairs:
        lo, hi = starts[seq], starts[seq + 1]
        tokens.extend(range(lo + first, min(lo + first + tile, hi)))
    return tokens


@pytest.mark.parametrize("seed", range(20))
def test_tiles_cover_each_prefill_token_once(seed):
    rng = np.random.default_rng(seed)
    tile = int(rng.choice([1, 4, 16, 32]))
    lens = rng.choice([0, 1, 1, 2, 5, 31, 32, 33, 100], size=int(rng.integers(1, 12)))
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    bound = max_prefill_tiles(int(starts[-1]), len(lens), tile)
    out = np.full(2 * bound, 7, dtype=np.int32)
    count = fill_prefill_tiles(starts, tile, out)
    pairs = out[:2 * count].reshape(-1, 2)
    want = [t for s, n in enumerate(lens) if n > 1 for t in range(starts[s], starts[s + 1])]
    assert covered_tokens(pairs, starts, tile) == want
    assert (out[2 * count:] == -1).all()
    assert all(first % tile == 0 for _, first in pairs)
    # With single-token rows included (the unpaged profile run) they get a tile each.
    count_all = fill_prefill_tiles(starts, tile, out, include_single=True)
    pairs = out[:2 * count_all].reshape(-1, 2)
    assert covered_tokens(pairs, starts, tile) == list(range(int(starts[-1])))


def test_list_too_short_is_an_error():
    with pytest.raises(ValueError, match="do not fit"):
        fill_prefill_tiles(np.array([0, 40], dtype=np.int32), 4, np.empty(8, np.int32))


def test_host_list_helper_matches_fill():
    tiles, count = prefill_tiles([0, 5, 6, 6, 20], 4, torch.device("cpu"))
    assert count == 2 + 4
    assert tiles[:12].view(-1, 2).tolist() == [[0, 0], [0, 4], [3, 0], [3, 4], [3, 8], [3, 12]]
    assert (tiles[12:] == -1).all()
