"""Step buffers: what `StepInputs.prepare` stages equals the metadata built by hand, padding
follows the graph contract (decode and mixed), views keep their addresses, growth stops
once frozen."""

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
    # Two empty sequences; the two pad tokens belong to none.
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3]
    assert meta.seq_lens.tolist() == [7, 3, 10, 0, 0]
    assert meta.block_tables.shape == (5, 4)  # the fixed width of max_model_len 16
    # The graph of size 5 captured these very views.
    ids, positions, captured = inputs.graph_views(5, mixed=False)
    assert_same_views(batch, ids, positions, captured)
    assert captured.seq_lens_cpu == [7, 3, 10, 0, 0] and captured.max_query_len == 1


def test_a_row_adding_no_token_is_refused():
    """The fused decode attention reads row i's new token at token i when every row adds
    one; a scheduled row of zero tokens would break that silently, so it is an error."""
    table, rows = table_with([[3, 7], [5], [1, 2, 6]])
    inputs = StepInputs(BatchLimits(8, 8, 16, BS), CPU)
    with pytest.raises(ValueError, match="at least one token"):
        inputs.prepare(table, rows, np.array([6, 2, 9]), np.array([1, 0, 1]), [11, 13],
                       logits_rows=None)


def assert_same_views(batch, ids, positions, captured) -> None:
    meta = batch.attn_metadata
    pairs = [(batch.input_ids, ids), (batch.positions, positions),
             (meta.slot_mapping, captured.slot_mapping),
             (meta.query_start_loc, captured.query_start_loc),
             (meta.seq_lens, captured.seq_lens), (meta.block_tables, captured.block_tables)]
    if meta.prefill_tiles is not None:
        pairs.append((meta.prefill_tiles, captured.prefill_tiles))
        assert meta.num_prefill_tiles == captured.num_prefill_tiles
    for live, static in pairs:
        assert live.data_ptr() == static.data_ptr() and live.shape == static.shape


def test_padded_mixed_step_follows_the_graph_contract():
    # A 6-token chunk after 5 cached tokens, a decode, a 3-token prompt: 10 tokens padded to
    # a graph of 16 tokens, which holds min(16, max_num_seqs=6) sequences.
    new, cached = [6, 1, 3], [5, 9, 0]
    blocks = [[3, 7, 8], [0, 2, 4], [10]]
    table, rows = table_with(blocks)
    inputs = StepInputs(BatchLimits(6, 32, 16, BS), CPU, prefill_tile_tokens=4,
                        decode_work_target=3)
    batch = inputs.prepare(table, rows, np.array(cached), np.array(new), list(range(100, 110)),
                           logits_rows=np.array([0, 1, 2]), pad_to=16)
    meta = batch.attn_metadata
    assert inputs.graph_seqs(16) == 6
    assert batch.input_ids.tolist() == list(range(100, 110)) + [0] * 6
    assert batch.positions.tolist()[10:] == [0] * 6
    assert meta.slot_mapping.tolist()[10:] == [-1] * 6
    assert meta.query_start_loc.tolist() == [0, 6, 7, 10, 10, 10, 10]
    assert meta.seq_lens.tolist() == [11, 10, 3, 0, 0, 0]
    assert batch.logits_indices.tolist() == [5, 6, 9]
    # Tiles of 4 tokens: the chunk's two, the prompt's one, none for the decode; the list
    # has room for ceil(16 / 4) + 6 = 10 and the graph launches all 10.
    tiles = meta.prefill_tiles.view(-1, 2).tolist()
    assert tiles[:3] == [[0, 0], [0, 4], [2, 0]] and tiles[3:] == [[-1, -1]] * 7
    assert meta.num_prefill_tiles == 10 and meta.prefill_tile_tokens == 4
    # The decode work list: the one decode row (10 tokens: one split), room for 6 + 3 items.
    work = meta.decode_work
    assert work.items.view(-1, 3).tolist() == [[1, 0, 1]] + [[-1, -1, -1]] * 8
    assert work.count == 9 and work.rows.view(-1, 2).tolist() == [[0, 0], [0, 1]] + [[0, 0]] * 4
    ids, positions, captured = inputs.graph_views(16, mixed=True)
    assert_same_views(batch, ids, positions, captured)
    assert captured.max_query_len == 2  # the general path
    for tensor in (batch.input_ids, batch.positions, meta.slot_mapping, meta.query_start_loc,
                   meta.seq_lens, meta.prefill_tiles, work.items, work.rows, meta.block_tables,
                   batch.logits_indices):
        assert tensor.data_ptr() % 16 == 0
    # Eagerly, the same step launches only its 3 tiles and its 1 decode item.
    eager = inputs.prepare(table, rows, np.array(cached), np.array(new), list(range(100, 110)),
                           logits_rows=np.array([0, 1, 2]))
    assert eager.attn_metadata.num_prefill_tiles == 3
    assert eager.attn_metadata.decode_work.count == 1
    with pytest.raises(ValueError, match="does not fit"):
        inputs.prepare(table, rows, np.array(cached), np.array(new), list(range(100, 110)),
                       logits_rows=None, pad_to=8)


def test_dummy_is_padding_only():
    inputs = StepInputs(BatchLimits(4, 8, 16, BS), CPU, prefill_tile_tokens=2)
    inputs.fill_dummy(8)
    for mixed in (False, True):
        ids, positions, meta = inputs.graph_views(8, mixed)
        assert ids.tolist() == [0] * 8 and positions.tolist() == [0] * 8
        assert meta.slot_mapping.tolist() == [-1] * 8
        assert meta.query_start_loc.tolist() == [0] * 5
        assert meta.seq_lens.tolist() == [0] * 4
        assert meta.prefill_tiles.tolist() == [-1] * 16 and meta.num_prefill_tiles == 8
        assert meta.max_query_len == (2 if mixed else 1)


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
