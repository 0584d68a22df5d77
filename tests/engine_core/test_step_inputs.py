"""Step buffers: what `StepInputs.prepare` stages equals the metadata built by hand, pad
rows follow the graph contract, views keep their addresses, growth stops once frozen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.worker.step_inputs import BatchLimits, HostBlockTable, StepInputs

BS = 4
CPU = torch.device("cpu")


def table_with(block_lists: list[list[int]]) -> tuple[HostBlockTable, np.ndarray]:
    table = HostBlockTable(2, 2)  # small on purpose: rows and width must grow
    rows = np.array([table.add(b) for b in block_lists], dtype=np.int64)
    return table, rows


def test_host_block_table_grows_appends_and_reuses_rows():
    table = HostBlockTable(1, 1)
    a = table.add([5, 6, 7])
    b = table.add([1])
    table.append(b, [2, 3])
    assert table.table[a, :3].tolist() == [5, 6, 7]
    assert table.table[b, :3].tolist() == [1, 2, 3]
    assert table.num_blocks[[a, b]].tolist() == [3, 3]
    table.free(a)
    c = table.add([9])
    assert c == a and table.num_blocks[c] == 1 and table.table[c, 0] == 9


def test_prepare_mixed_batch_matches_hand_built_metadata(make_metadata, positions_of):
    # A prefill chunk after 5 cached tokens, a decode, a fresh 3-token prompt.
    new, cached = [6, 1, 3], [5, 9, 0]
    blocks = [[3, 7, 8], [0, 2, 4], [10]]
    table, rows = table_with(blocks)
    inputs = StepInputs(BatchLimits(1, 1, 8, BS), CPU)
    token_ids = list(range(100, 110))
    batch = inputs.prepare(table, rows, np.array(cached), np.array(new), token_ids,
                           logits_rows=np.array([0, 2]))
    want = make_metadata(new, cached, blocks, BS)
    meta = batch.attn_metadata
    assert batch.input_ids.tolist() == token_ids
    assert torch.equal(batch.positions, positions_of(new, cached))
    assert meta.slot_mapping.tolist() == want.slot_mapping.tolist()
    assert meta.query_start_loc.tolist() == want.query_start_loc.tolist()
    assert meta.seq_lens.tolist() == want.seq_lens.tolist()
    width = want.block_tables.shape[1]
    assert torch.equal(meta.block_tables[:, :width], want.block_tables)
    assert (meta.query_start_loc_cpu, meta.seq_lens_cpu) == (want.query_start_loc_cpu,
                                                             want.seq_lens_cpu)
    assert (meta.max_query_len, meta.max_seq_len) == (6, 11)
    assert batch.logits_indices.tolist() == [5, 9]  # last token of sequences 0 and 2
    # Triton specialises on 16-byte alignment: odd section sizes must not shift pointers.
    for tensor in (batch.input_ids, batch.positions, meta.slot_mapping, meta.query_start_loc,
                   meta.seq_lens, meta.block_tables, batch.logits_indices):
        assert tensor.data_ptr() % 16 == 0


def test_padded_decode_follows_the_graph_contract():
    blocks = [[3, 7], [5], [1, 2, 6]]
    cached = [6, 2, 9]
    table, rows = table_with(blocks)
    inputs = StepInputs(BatchLimits(8, 8, 16, BS), CPU)
    batch = inputs.prepare(table, rows, np.array(cached), np.ones(3, dtype=np.int64),
                           [11, 12, 13], logits_rows=None, pad_to=5)
    meta = batch.attn_metadata
    assert batch.logits_indices is None
    assert batch.input_ids.tolist() == [11, 12, 13, 0, 0]
    assert batch.positions.tolist() == [6, 2, 9, 0, 0]
    assert meta.slot_mapping.tolist() == [7 * BS + 2, 5 * BS + 2, 6 * BS + 1, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    assert meta.seq_lens.tolist() == [7, 3, 10, 0, 0]
    assert meta.block_tables.shape == (5, 4)  # the fixed width of max_model_len 16
    # The graph of size 5 captured these very views.
    ids, positions, captured = inputs.decode_views(5)
    for live, static in ((batch.input_ids, ids), (batch.positions, positions),
                         (meta.slot_mapping, captured.slot_mapping),
                         (meta.query_start_loc, captured.query_start_loc),
                         (meta.seq_lens, captured.seq_lens),
                         (meta.block_tables, captured.block_tables)):
        assert live.data_ptr() == static.data_ptr() and live.shape == static.shape
    assert captured.seq_lens_cpu == [7, 3, 10, 0, 0]


def test_dummy_decode_is_pad_rows_only():
    inputs = StepInputs(BatchLimits(4, 4, 16, BS), CPU)
    inputs.fill_dummy_decode(4)
    ids, positions, meta = inputs.decode_views(4)
    assert ids.tolist() == [0] * 4 and positions.tolist() == [0] * 4
    assert meta.slot_mapping.tolist() == [-1] * 4
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [0] * 4 and meta.max_query_len == 1


def test_buffers_grow_until_frozen():
    table, rows = table_with([[0, 1, 2, 3, 4]])
    inputs = StepInputs(BatchLimits(1, 2, 4, BS), CPU)
    batch = inputs.prepare(table, rows, np.array([0]), np.array([20]), list(range(20)),
                           logits_rows=np.array([0]))
    assert batch.attn_metadata.slot_mapping.tolist() == list(range(20))
    inputs.freeze()
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        inputs.prepare(table, rows, np.array([0]), np.array([40]), list(range(40)),
                       logits_rows=np.array([0]))
