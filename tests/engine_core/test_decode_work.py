"""The decode kernel's work list for mixed steps: decode rows only, splits by length and share,
items consecutive per row, the bound never exceeded, unused entries -1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.attention.decode_work import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    decode_work,
    fill_decode_work,
    max_decode_items,
)


def build(q_lens: list[int], seq_lens: list[int], target: int) -> tuple[np.ndarray, np.ndarray, int]:
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    items = np.full(3 * max_decode_items(len(q_lens), target), 7, dtype=np.int32)
    rows = np.full(2 * len(q_lens), 7, dtype=np.int32)
    count = fill_decode_work(starts, np.asarray(seq_lens, dtype=np.int32), target, items, rows)
    return items, rows, count


def test_one_long_decode_beside_a_prompt_gets_the_share():
    # A 32k decode, a 64-token prompt chunk, an 8k decode, graph padding (an empty sequence).
    items, rows, count = build([1, 64, 1, 0], [32768, 64, 8192, 0], target=33)
    triples = items[:3 * count].reshape(-1, 3)
    long_splits = min(-(-33 * 32768 // 40960), 32768 // MIN_TOKENS_PER_SPLIT)
    short_splits = min(-(-33 * 8192 // 40960), 8192 // MIN_TOKENS_PER_SPLIT)
    assert count == long_splits + short_splits
    assert triples[:long_splits].tolist() == [[0, i, long_splits] for i in range(long_splits)]
    assert triples[long_splits:].tolist() == [[2, i, short_splits] for i in range(short_splits)]
    assert (items[3 * count:] == -1).all()
    assert rows.reshape(-1, 2).tolist() == [[0, long_splits], [0, 0],
                                            [long_splits, short_splits], [0, 0]]


@pytest.mark.parametrize("seed", range(30))
def test_random_steps_stay_within_bounds(seed):
    rng = np.random.default_rng(seed)
    num = int(rng.integers(1, 40))
    q_lens = rng.choice([0, 1, 1, 1, 7, 200], size=num)
    seq_lens = np.where(q_lens == 0, 0, q_lens + rng.integers(0, 70000, size=num))
    target = int(rng.choice([1, 17, 33, 66]))
    items, rows, count = build(q_lens.tolist(), seq_lens.tolist(), target)
    assert count <= max_decode_items(num, target)
    triples = items[:3 * count].reshape(-1, 3)
    pairs = rows.reshape(-1, 2)
    decode = np.flatnonzero(q_lens == 1)
    assert sorted(set(triples[:, 0].tolist())) == decode.tolist()
    for seq in range(num):
        first, splits = pairs[seq]
        if seq not in decode:
            assert (first, splits) == (0, 0)
            continue
        assert 1 <= splits <= MAX_SPLITS
        assert splits == 1 or -(-seq_lens[seq] // splits) >= MIN_TOKENS_PER_SPLIT // 2
        assert triples[first:first + splits].tolist() == [[seq, i, splits] for i in range(splits)]


def test_no_decode_rows_and_a_short_list():
    items, rows, count = build([5, 0], [5, 0], target=33)
    assert count == 0 and (items == -1).all() and (rows == 0).all()
    with pytest.raises(ValueError, match="do not fit"):
        fill_decode_work(np.array([0, 1], np.int32), np.array([5000], np.int32), 33,
                         np.empty(6, np.int32), np.empty(2, np.int32))


def test_host_list_helper():
    work = decode_work([0, 1, 3], [2000, 3], 33, torch.device("cpu"))
    assert work.count == 8 and work.rows.tolist() == [0, 8, 0, 0]
